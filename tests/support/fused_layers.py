"""The layers the fused kernels take, and the row they run on (tests/modeling/attention/test_fused_kernels.py,
test_fused_compile.py)."""

LENGTHS = [5, 1, 9, 14]

LAYERS = {
    # name: (head dim, heads, kv heads, attention options, flash-attn installed, the kernel called)
    "sinks": (64, 8, 2, dict(s_aux="sinks"), True, "varlen_attn"),
    "softcap_flash_attn": (256, 8, 4, dict(softcap=50.0), True, "flash_attn_varlen_func"),
    "softcap_flex": (256, 8, 4, dict(softcap=50.0), False, "flex_attention"),
    "softcap_flex_window": (256, 8, 4, dict(softcap=50.0, sliding_window=4), False, "flex_attention"),
    "wide_heads": (512, 8, 2, dict(), True, "efficient_attention"),
}
