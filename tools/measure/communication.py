"""Bytes each rank receives (= sends) per layer and per step for one packed row of T tokens, context parallelism
(all-gather K/V) against DeepSpeed Ulysses; bf16, activation checkpointing on, reference forward every step."""

MODELS = {  # layers, heads, kv heads, head_dim
    "Llama-3.1-8B": (32, 32, 8, 128),
    "Qwen2.5-7B": (28, 28, 4, 128),
}
T, B = 131072, 2
FORWARD_PASSES = 3  # policy forward, its recomputation (checkpointing), reference forward
OUTPUT_BYTES_FORWARD, OUTPUT_BYTES_BACKWARD = 14 + 5, 4  # per row token, fp32/bool outputs of TRL's fused LM head
MiB, GiB = 2**20, 2**30


def context_parallel(layers, heads, kv_heads, head_dim, size):
    layer = (size - 1) / size * T * 2 * kv_heads * head_dim * B  # forward all-gather = backward reduce-scatter
    outputs = (size - 1) / size * T * (OUTPUT_BYTES_FORWARD + OUTPUT_BYTES_BACKWARD)
    return layer, layer, layers * (FORWARD_PASSES + 1) * layer + outputs


def ulysses(layers, heads, kv_heads, head_dim, size):
    if heads % size or (kv_heads % size and size % kv_heads):
        return None
    kv_sent = max(kv_heads, size)  # KV heads repeated when size > kv_heads
    all_to_all = (size - 1) / size * T / size * (2 * heads + 2 * kv_sent) * head_dim * B  # q, k, v, output
    position_ids = (size - 1) / size * T * 8
    outputs = (size - 1) / size * T * (OUTPUT_BYTES_FORWARD + OUTPUT_BYTES_BACKWARD)
    step = layers * (FORWARD_PASSES * (all_to_all + position_ids) + all_to_all) + outputs
    return all_to_all + position_ids, all_to_all, step


print(
    "| model | ranks | CP per layer fwd / bwd (MiB) | Ulysses per layer fwd / bwd (MiB) | CP per step (GiB) | Ulysses per step (GiB) | CP / Ulysses |"
)
print("|---|---|---|---|---|---|---|")
for name, shape in MODELS.items():
    for size in (4, 8):
        cp = context_parallel(*shape, size)
        sp = ulysses(*shape, size)
        cells = [f"{cp[0] / MiB:.0f} / {cp[1] / MiB:.0f}"]
        if sp is None:
            cells += ["not allowed (heads)", f"{cp[2] / GiB:.1f}", "-", "-"]
        else:
            cells += [
                f"{sp[0] / MiB:.1f} / {sp[1] / MiB:.1f}",
                f"{cp[2] / GiB:.1f}",
                f"{sp[2] / GiB:.1f}",
                f"{cp[2] / sp[2]:.2f}",
            ]
        print(f"| {name} | {size} | " + " | ".join(cells) + " |")
