"""Longest packed DPO row per GPU count under DeepSpeed Ulysses, from trl-padfree's memory planner (an estimate).

Writes three model configs to ./<name>/config.json, then for each case binary-searches the most tokens per GPU
t = row / sp that the planner fits in 80 GiB, with its 3 GiB reserve raised by the Ulysses buffers of t tokens.
"""

from dataclasses import replace

from transformers import LlamaConfig, Qwen2Config

from trl_padfree.plan import GiB, Setup, estimate, load_model_shape

MODELS = {  # name: (config, sp sizes that Ulysses accepts and that divide 8 GPUs)
    "llama-3.1-8b": (
        LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        ),
        (1, 2, 4, 8),
    ),
    "qwen2.5-7b": (
        Qwen2Config(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
        (1, 2, 4),
    ),
    "llama-3.1-70b": (
        LlamaConfig(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        ),
        (1, 2, 4, 8),
    ),
}
CASES = [  # (model, Setup fields)
    ("llama-3.1-8b", dict(reference="gpu")),
    ("llama-3.1-8b", dict(reference="offload")),
    ("qwen2.5-7b", dict(reference="gpu")),
    ("qwen2.5-7b", dict(reference="offload")),
    ("llama-3.1-70b", dict(reference="gpu")),
    ("llama-3.1-70b", dict(reference="gpu", offload_optimizer=True)),
    ("llama-3.1-70b", dict(reference="offload", offload_optimizer=True)),
]
B = 2  # bf16


def ulysses_bytes(config, t, sp):
    """What Ulysses adds per GPU for t local tokens, an estimate (docs/concepts/memory-planning.md)."""
    if sp == 1:
        return 0
    head_dim = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    kv_sent = max(kv, sp * head_dim)  # DeepSpeed repeats KV heads when sp > num_key_value_heads
    exchange = 3 * B * (q + 2 * kv_sent)  # send buffer, receive buffer, head-major copy for the kernel
    o_proj_input = 2 * B * q  # no longer a view of the attention output: recomputed layer and its backward
    repeated_kv = 2 * 2 * B * (kv_sent - kv)  # larger saved k and v when KV heads are repeated
    position_ids = 2 * 8 * sp  # all-gathered int64 position_ids: the gathered list and their concatenation
    return t * (exchange + o_proj_input + repeated_kv + position_ids)


def max_tokens_per_gpu(shape, config, setup, sp):
    def fits(t):
        return estimate(shape, replace(setup, tokens=t, reserve=3 * GiB + ulysses_bytes(config, t, sp))).fits

    low, high = 0, 1 << 24  # fits(low), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def main():
    for name, (config, _) in MODELS.items():
        config.save_pretrained(name)
    print(
        "| model | ZeRO-3 | reference | sp | tokens/GPU | row = longest pair | GPU GiB: policy + ref + act + Ulysses "
        "+ reserve | CPU GiB/node |"
    )
    print("|---|---|---|---|---|---|---|---|")
    checks = []
    for name, fields in CASES:
        config, sp_sizes = MODELS[name]
        shape = load_model_shape(name)
        setup = Setup(gpus_per_node=8, nodes=1, gpu_memory=80 * GiB, zero_stage=3, **fields)
        offload = "optimizer offload" if setup.offload_optimizer else "no offload"
        for sp in sp_sizes:
            t = max_tokens_per_gpu(shape, config, setup, sp)
            extra = ulysses_bytes(config, t, sp)
            e = estimate(shape, replace(setup, tokens=max(t, 1), reserve=3 * GiB + extra))
            parts = " + ".join(f"{x / GiB:.1f}" for x in (e.policy_gpu, e.reference_gpu, e.activations_gpu, extra))
            print(
                f"| {name} | {offload} | {setup.reference} | {sp} | {t:,} | {sp * t:,} | {parts} + 3.0 "
                f"| {e.cpu_total / GiB:.0f} |"
            )
            if t:
                flags = f"--reference {setup.reference}" + (" --offload-optimizer" if setup.offload_optimizer else "")
                for tokens in (t, t + 1):
                    reserve_kib = -(-(3 * GiB + ulysses_bytes(config, tokens, sp)) // 1024)
                    checks.append(f"trl-padfree plan {name} {flags} --tokens {tokens} --reserve {reserve_kib}k")
    print("\nCLI checks (the first of each pair fits, the second does not):")
    print("\n".join(checks))


if __name__ == "__main__":
    main()
