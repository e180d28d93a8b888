"""Longest packed DPO row per context-parallel size, from trl-padfree's memory planner (an estimate).

Writes two model configs to ./<name>/config.json, then for each case binary-searches the longest row T that the
planner fits in 80 GiB per GPU with `context_parallel_size=C`: each GPU runs T / C tokens and holds the row's
gathered keys and values (trl_padfree/plan/context_parallel.py).
"""

from dataclasses import replace

from ulysses_capacity import MODELS as ULYSSES_MODELS  # the script's own folder is on sys.path

from trl_padfree.plan import GiB, Setup, estimate, load_model_shape

# The same configs as the Ulysses capacity script, for the two models compared here
MODELS = {name: ULYSSES_MODELS[name][0] for name in ("llama-3.1-8b", "qwen2.5-7b")}
CP_SIZES = (1, 2, 4, 8)  # no head-count limit: every size dividing the 8 GPUs


def longest_row(shape, setup):
    low, high = 0, 1 << 24  # fits(low), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if estimate(shape, replace(setup, tokens=middle)).fits else (low, middle)
    return low


def main():
    for name, config in MODELS.items():
        config.save_pretrained(name)
    print(
        "| model | reference | C | longest pair T | tokens/GPU | GPU GiB: policy + ref + act + K/V buffers + reserve |"
    )
    print("|---|---|---|---|---|---|")
    checks = []
    for name in MODELS:
        shape = load_model_shape(name)
        for reference in ("gpu", "offload"):
            for size in CP_SIZES:
                setup = Setup(gpus_per_node=8, zero_stage=3, reference=reference, context_parallel_size=size)
                row = longest_row(shape, setup)
                e = estimate(shape, replace(setup, tokens=row))
                parts = (e.policy_gpu, e.reference_gpu, e.activations_gpu, e.context_parallel_gpu, e.reserve_gpu)
                print(
                    f"| {name} | {reference} | {size} | {row:,} | {-(-row // size):,} | "
                    f"{' + '.join(f'{part / GiB:.1f}' for part in parts)} = {e.gpu_total / GiB:.1f} |"
                )
                for tokens in (row, row + 1):
                    checks.append(
                        f"trl-padfree plan {name} --reference {reference} --context-parallel {size} --tokens {tokens}"
                    )
    print("\nCLI checks (the first of each pair fits, the second does not):")
    print("\n".join(checks))


if __name__ == "__main__":
    main()
