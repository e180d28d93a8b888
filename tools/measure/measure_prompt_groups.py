"""Tokens and FLOPs one DPO step computes for many pairs of one prompt: padded TRL, prefix sharing pair by pair, and
prompt groups (each prompt and each distinct completion once), against the ideal.

Run from the repository root: `python tools/measure/measure_prompt_groups.py [--output docs/bench/prompt_groups.json]`.

Every row is one micro-batch of one prompt's pairs, as `train_sampling_strategy="group_by_prompt"` batches them: K
completions of about C tokens (0.8 C to 1.2 C, seeded), paired all ways (every better with every worse: K(K-1)/2 pairs)
or best against worst (1 pair). Tokens are counted on the rows the real collator lays out (`concatenated_inputs`, no
row padding): padded TRL's batch is 2 x pairs sequences padded to the longest; pair by pair is each pair collated alone
with prefix sharing; grouped is the whole batch collated with prefix sharing. The ideal computes the prompt once and
each distinct completion once, plus the one prompt token each further completion repeats (prefix-sharing.md). FLOPs
are the cost model's (trl_padfree/costs/flops.py) for one training step (policy forward and backward, reference
forward) of Llama 3.1 8B's shape on those rows: linear layers per token, the LM head per completion token, attention
per (query, key) pair the kernel computes (padded: the full square under a padding mask).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from transformers import AutoConfig  # noqa: E402

from trl_padfree.cli.bench.harness import MODEL_SHAPES, batch_work  # noqa: E402
from trl_padfree.cli.bench.report import run_provenance  # noqa: E402
from trl_padfree.costs.flops import DecoderShape, padded_batch_work, training_step_flops  # noqa: E402
from trl_padfree.packing.collator import concatenated_inputs  # noqa: E402

MODEL = "llama3.1-8b"
COMPLETIONS = (2, 4, 8)
PAIRINGS = ("all_pairs", "best_vs_worst")
PROMPTS = (512, 1024, 2048, 4096)
COMPLETION_LENGTHS = (128, 256, 512)
VOCAB = 32000


def examples_of_one_prompt(prompt: int, completions: int, length: int, pairing: str, seed: int) -> list[dict]:
    """One prompt's pairs: `completions` completions of about `length` tokens, ranked by index (0 best)."""
    rng = random.Random(seed)
    prompt_ids = [rng.randrange(3, VOCAB) for _ in range(prompt)]
    texts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(int(0.8 * length), int(1.2 * length)))]
             for _ in range(completions)]  # fmt: skip
    if pairing == "best_vs_worst":
        pairs = [(0, completions - 1)]
    else:
        pairs = list(itertools.combinations(range(completions), 2))
    return [{"prompt_ids": prompt_ids, "chosen_ids": texts[a], "rejected_ids": texts[b]} for a, b in pairs]


def measure(shape: DecoderShape, prompt: int, completions: int, length: int, pairing: str) -> dict:
    examples = examples_of_one_prompt(
        prompt, completions, length, pairing, seed=prompt * 31 + completions * 7 + length
    )
    sequences = [len(e["prompt_ids"]) + len(e[side]) for e in examples for side in ("chosen_ids", "rejected_ids")]
    scored = sum(len(e[side]) for e in examples for side in ("chosen_ids", "rejected_ids"))
    padded = padded_batch_work(sequences, scored)
    pair_by_pair = [batch_work(concatenated_inputs([example], prefix_sharing=True)) for example in examples]
    per_pair_work = sum(pair_by_pair[1:], pair_by_pair[0])
    grouped_work = batch_work(concatenated_inputs(examples, prefix_sharing=True))
    distinct = {tuple(e[side]) for e in examples for side in ("chosen_ids", "rejected_ids")}
    ideal_tokens = prompt + sum(len(c) for c in distinct) + len(distinct) - 1
    flops = {name: training_step_flops(shape, work) for name, work in
             (("padded", padded), ("pair_by_pair", per_pair_work), ("grouped", grouped_work))}  # fmt: skip
    return {
        "completions": completions,
        "pairing": pairing,
        "pairs": len(examples),
        "prompt_tokens": prompt,
        "completion_tokens": length,
        "tokens": {
            "padded": padded.tokens,
            "pair_by_pair": per_pair_work.tokens,
            "grouped": grouped_work.tokens,
            "ideal": ideal_tokens,
        },
        "step_tflops": {name: value / 1e12 for name, value in flops.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write the rows as JSON (docs/bench/prompt_groups.json)")
    options = parser.parse_args(argv)
    shape = DecoderShape.from_config(AutoConfig.for_model(**MODEL_SHAPES[MODEL]))
    rows = [
        measure(shape, prompt, completions, length, pairing)
        for pairing in PAIRINGS
        for completions in COMPLETIONS
        for prompt in PROMPTS
        for length in COMPLETION_LENGTHS
    ]
    for row in rows:
        tokens = row["tokens"]
        print(
            f"K={row['completions']} {row['pairing']:13} P={row['prompt_tokens']:5} C={row['completion_tokens']:4} "
            f"pairs={row['pairs']:3} tokens padded={tokens['padded']:7} pair-by-pair={tokens['pair_by_pair']:7} "
            f"grouped={tokens['grouped']:7} ideal={tokens['ideal']:7}"
        )
    if options.output is not None:
        report = {"provenance": run_provenance(vars(options)), "model": MODEL, "rows": rows}
        options.output.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
