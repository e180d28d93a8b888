"""Measure what setting up balanced batches and token budgets costs per process, and the partition per step.

Run from the repository root (figures in docs/concepts/balancing.md and docs/guides/long-sequences.md):

    python3 tools/measure/measure_pricing.py --pairs 100000 --sample 100  # --output FILE.json keeps the report

What it times, on one CPU process unless said:
- vision-language pairs (`packing/pair_sizes.py`): a synthetic set of `--pairs` pairs as Qwen2.5-VL's processor sees
  it (tests/support/tiny_vision/'s processor with Qwen2.5-VL's own image settings: min_pixels 56 x 56, max_pixels
  12845056; images of 336 x 448 to 640 x 480 pixels, 120 to 391 image tokens; 1-12 word prompts, 1-16 word
  completions). Per pair: collated (the processor's image processing included: what every process did for every
  pair before) and counted from the image sizes (after); timed on `--sample` pairs and extrapolated per pair. Per
  process at N processes: before, every pair collated; after, N-th of the pairs counted plus one gather;
- the gather: `pair_sizes.gather_shares` of the whole set's sizes over 2 and 4 gloo processes;
- the cache hit: `pair_sizes.pair_sizes` on a set whose sizes are cached (its key, the processor's digest included,
  and the file read and checked), for `--pairs` pairs;
- text pairs: `balanced_batches.pair_costs` and `token_budget.pair_lengths` on `--pairs` tokenized pairs;
- the partition: one optimizer step's `BalancedBatchSampler.step_bins` (`balance.best_split`) at 8, 64 and 512
  processes, 4 pairs per process and 4 micro-steps, UltraFeedback-like lengths.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers
from tiny_vision import make_vision_processor, vision_preference_rows  # noqa: E402

from trl_padfree.cli.bench.report import run_provenance
from trl_padfree.costs.flops import DecoderShape  # noqa: E402
from trl_padfree.packing import pair_sizes as priced  # noqa: E402
from trl_padfree.packing.balanced_batches import BalancedBatchSampler, pair_costs  # noqa: E402
from trl_padfree.packing.token_budget import pair_lengths  # noqa: E402
from trl_padfree.packing.units import PairUnits  # noqa: E402
from trl_padfree.packing.vision import PaddingFreeVisionPreferenceCollator  # noqa: E402

IMAGE_SIDES = [(336, 448), (448, 448), (384, 512), (480, 640)]
PROCESS_COUNTS = (1, 8, 64)


def vision_rows(count: int) -> list[dict]:
    """Rows of tests/support/tiny_vision/ with realistic image sizes (a few images, shared: building is not timed)."""
    generator = np.random.default_rng(0)
    images = [Image.fromarray(generator.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in IMAGE_SIDES]
    rows = vision_preference_rows("qwen2_5_vl", count, sizes=[(8, 8)])
    for number, row in enumerate(rows):
        row["images"] = [images[number % len(images)]]
    return rows


def per_pair(function, rows) -> float:
    start = time.perf_counter()
    for row in rows:
        function(row)
    return (time.perf_counter() - start) / len(rows)


def _gather_worker(rank: int, world: int, port: int, pairs: int, times) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    per_rank = -(-pairs // world)
    share = torch.ones(min(per_rank, pairs - rank * per_rank), 4, dtype=torch.long)
    priced.gather_shares(share, pairs, world, torch.device("cpu"))  # warm-up: the first collective connects
    dist.barrier()
    start = time.perf_counter()
    priced.gather_shares(share, pairs, world, torch.device("cpu"))
    times[rank] = time.perf_counter() - start
    dist.destroy_process_group()


def gather_seconds(world: int, pairs: int) -> float:
    times = multiprocessing.Manager().dict()
    port = random.randint(20000, 40000)
    multiprocessing.spawn(_gather_worker, args=(world, port, pairs, times), nprocs=world)
    return max(times.values())


def partition_seconds(processes: int, steps: int = 3) -> float:
    rng = random.Random(0)
    pairs_per_step = processes * 4 * 4
    # UltraFeedback-like rows: prompt ~ lognormal around 160 tokens, completions around 300
    costs = [rng.lognormvariate(6.2, 0.6) for _ in range(pairs_per_step * steps)]
    sampler = BalancedBatchSampler(PairUnits(costs), 4, processes=processes, micro_steps=4, seed=0)
    times = []
    bins = sampler.step_bins()
    for _ in range(steps):
        start = time.perf_counter()
        next(bins)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--sample", type=int, default=200)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict = {"provenance": run_provenance(vars(args))}

    processor = make_vision_processor("qwen2_5_vl", min_pixels=56 * 56, max_pixels=12845056)
    collator = PaddingFreeVisionPreferenceCollator(processor=processor)
    rows = vision_rows(args.sample * 10)
    collated = per_pair(lambda row: priced.collated_sizes(row, collator), rows[: args.sample])
    counted = per_pair(lambda row: priced.counted_sizes(row, collator), rows)
    tokens = [priced.counted_sizes(row, collator)[0] for row in rows[:8]]
    gathers = {world: gather_seconds(world, args.pairs) for world in (2, 4)}
    gather = max(gathers.values())
    report["vision"] = {
        "pairs": args.pairs,
        "chosen_tokens_first_pairs": tokens,
        "collated_ms_per_pair": 1e3 * collated,
        "counted_ms_per_pair": 1e3 * counted,
        "gather_s": gathers,
        "per_process_s": {
            processes: {
                "before": args.pairs * collated,
                "after_counted": -(-args.pairs // processes) * counted + (gather if processes > 1 else 0.0),
                "after_collated": -(-args.pairs // processes) * collated + (gather if processes > 1 else 0.0),
            }
            for processes in PROCESS_COUNTS
        },
    }

    # The cache hit: a set of args.pairs pairs (text columns: the fingerprint is what matters) with its sizes cached
    with tempfile.TemporaryDirectory() as folder:
        datasets.config.HF_DATASETS_CACHE = folder
        hit_set = datasets.Dataset.from_dict({"prompt": [str(i) for i in range(args.pairs)]})
        key = priced.cache_key(hit_set, collator)
        priced.write_cache(priced.cache_path(hit_set, key), key, torch.ones(args.pairs, 4, dtype=torch.long))
        start = time.perf_counter()
        priced.pair_sizes(hit_set, collator, show_progress=False)
        report["vision"]["cache_hit_s"] = time.perf_counter() - start

    # Text pairs, tokenized by TRL: lengths and costs from the token columns alone
    rng = random.Random(0)
    text = datasets.Dataset.from_dict(
        {
            column: [[1] * rng.randint(20, 600) for _ in range(args.pairs)]
            for column in ("prompt_ids", "chosen_ids", "rejected_ids")
        }
    )
    shape = DecoderShape(linear_params=10**9, hidden_size=2048, vocab_size=151936, attention_layers=24,
                         num_attention_heads=16, head_dim=128)  # fmt: skip
    start = time.perf_counter()
    pair_costs(text, shape, 1024, "keep_start", None, True)
    costs_s = time.perf_counter() - start
    start = time.perf_counter()
    pair_lengths(text, 1024)
    report["text"] = {"pairs": args.pairs, "pair_costs_s": costs_s, "pair_lengths_s": time.perf_counter() - start}
    report["partition_s_per_step"] = {processes: partition_seconds(processes) for processes in (8, 64, 512)}
    print(json.dumps(report, indent=2))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
