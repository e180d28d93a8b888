"""Bytes the varlen kernel keeps for the backward per attention layer, grouped key/value heads passed grouped and
expanded to the query heads first, through torch 2.11's stand-in on CPU, which saves what torch's op saves (query,
key, value, output, log-sum-exp, boundaries, generator state). The rest of a layer's saved activations is the same
either way.

    PYTHONPATH=.:tests python tools/measure/measure_grouped_heads.py   # from the repository root
"""

import torch
from stand_in_kernels import varlen_stand_in
from test_grouped_heads import saved_while

from trl_padfree.modeling.attention.varlen import KernelSession, varlen_attention
from trl_padfree.modeling.check.stand_ins import stand_in_kernels

GEOMETRIES = {"Llama-3-8B": (32, 8, 128), "Llama-3-70B": (64, 8, 128)}  # query heads, key/value heads, head dim
BOUNDS = (0, 300, 301, 700, 1024)  # 1,024 tokens in four sequences


def saved_bytes(heads: int, kv_heads: int, head_dim: int, expand: bool) -> int:
    length, longest = BOUNDS[-1], max(b - a for a, b in zip(BOUNDS, BOUNDS[1:], strict=False))
    query = torch.randn(1, heads, length, head_dim, dtype=torch.bfloat16, requires_grad=True)
    key, value = (torch.randn(1, kv_heads, length, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    cu_seq_lens = torch.tensor(BOUNDS, dtype=torch.int32)

    def layer():
        # expanded: the heads repeated to the query heads ahead of the call
        k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (key, value)) if expand else (key, value)
        return varlen_attention(
            query, k, v, cu_seq_lens, cu_seq_lens, longest, longest,
            session=KernelSession(), scaling=head_dim**-0.5, sliding_window=None, dropout=0.0,
        )  # fmt: skip

    with stand_in_kernels(varlen=varlen_stand_in("2.11")):
        saved_while(layer)
    return saved_while.bytes


def main() -> None:
    print(f"torch {torch.__version__}, bf16, {BOUNDS[-1]} tokens, torch 2.11's varlen_attn stand-in, per layer")
    for name, geometry in GEOMETRIES.items():
        expanded, grouped = saved_bytes(*geometry, expand=True), saved_bytes(*geometry, expand=False)
        print(
            f"{name:12} expanded {expanded / 2**20:6.2f} MiB   grouped {grouped / 2**20:6.2f} MiB   x{expanded / grouped:.2f}"
        )


if __name__ == "__main__":
    main()
