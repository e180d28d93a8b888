"""Measure what each rank of a split vision-language row spends on the vision tower, on CPU, for the choice of how the
tower runs under sequence and context parallelism (docs/guides/vision-language.md, "Long rows").

Run from the repository root, on a quiet machine:

    python3 tools/measure/measure_vision_split.py --output docs/bench/vision_split_cpu.json

A Qwen2.5-VL built locally (`--text-width`, `--vision-width`, 4 layers each), one packed row of the shipped
conversational pairs with `--images` noise images per prompt, the images resized to about `--image-tokens` tokens
each. Medians of `--repeats` after 2 warm-ups, forward and backward each, one CPU thread per rank:

- vision tower, all images: every rank encodes all of the row's images (`deal_images=False`), one process;
- vision tower, dealt: `--ranks` processes over gloo, each running the model's `get_image_features` on its share of
  the images (parallel/image_shares.py's `deal_units` over the collator's units) and gathering every rank's features
  (`gathered_features`: the exchange of sizes, the all-gather, and in the backward the all-reduce), timed as the
  slowest rank's; with more processes than cores every process is slowed alike (the JSON records the cores);
- language model, 1/ranks of the row: each rank's chunk, from embeddings to the last hidden state.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers

from tiny_vision import make_vision_model, make_vision_processor, vision_preference_rows  # noqa: E402

from trl_padfree.cli.bench.report import run_provenance
from trl_padfree.packing.vision import IMAGE_UNITS, PaddingFreeVisionPreferenceCollator  # noqa: E402
from trl_padfree.parallel.groups import RowGroup  # noqa: E402
from trl_padfree.parallel.image_shares import deal_units, gathered_features  # noqa: E402


def timed(function, repeats: int) -> float:
    for _ in range(2):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest_rank_seconds(local: float) -> float:
    seconds = [None] * dist.get_world_size()
    dist.all_gather_object(seconds, local)
    return max(seconds)


def dealt_worker(rank: int, ranks: int, options, init_file: str, results) -> None:
    """One rank of a row: its share of the images through the vision tower, every rank's features gathered."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
    model, batch = build(options)
    units, images = batch[IMAGE_UNITS], batch["image_inputs"]
    row = RowGroup(dist.group.WORLD, rank, ranks)
    share = units.share(images, *deal_units(units.image_tokens, ranks)[rank])
    encoder = model.model

    def dealt():
        output = gathered_features(encoder.get_image_features(share["pixel_values"], share["image_grid_thw"]), row)
        torch.cat(output.pooler_output).float().sum().backward()

    for _ in range(2):
        dealt()
    times = []
    for _ in range(options.repeats):
        dist.barrier()
        start = time.perf_counter()
        dealt()
        times.append(slowest_rank_seconds(time.perf_counter() - start))
    if rank == 0:
        results.put(statistics.median(times))
    dist.destroy_process_group()


def build(options):
    """The model and the packed row, the same in every process (seeded)."""
    torch.manual_seed(0)
    token_pixels = 28**2
    processor = make_vision_processor(
        "qwen2_5_vl", min_pixels=options.image_tokens * token_pixels, max_pixels=options.image_tokens * token_pixels
    )
    width, vision_width = options.text_width, options.vision_width
    head_dim = width // 8
    sections = [head_dim // 4, head_dim // 8, head_dim // 8]  # mRoPE over half of each head: time, height, width
    text = dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                mrope_section=sections))  # fmt: skip
    vision = dict(hidden_size=vision_width, intermediate_size=2 * vision_width, depth=4, num_heads=4,
                  out_hidden_size=width)  # fmt: skip
    model = make_vision_model("qwen2_5_vl", processor, text_config=text, vision_config=vision)
    model.train()
    rows = vision_preference_rows("qwen2_5_vl", options.pairs, images_per_row=options.images, sizes=[(224, 224)])
    collator = PaddingFreeVisionPreferenceCollator(processor, image_token_id=model.config.image_token_id)
    return model, collator(rows)


def dealt_seconds(ranks: int, options) -> float:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        workers = [
            context.Process(target=dealt_worker, args=(rank, ranks, options, f"{scratch}/init", results))
            for rank in range(ranks)
        ]
        for worker in workers:
            worker.start()
        seconds = results.get()
        for worker in workers:
            worker.join()
    return seconds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text-width", type=int, default=512)
    parser.add_argument("--vision-width", type=int, default=256)
    parser.add_argument("--images", type=int, default=4, help="images per prompt")
    parser.add_argument("--image-tokens", type=int, default=64, help="about this many tokens per image")
    parser.add_argument("--pairs", type=int, default=4, help="pairs in the row")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, batch = build(options)
    width = options.text_width
    images = batch["image_inputs"]
    pixels, grids = images["pixel_values"], images["image_grid_thw"]
    row_length = batch["input_ids"].shape[1]
    image_tokens = int((batch["input_ids"] == model.config.image_token_id).sum())

    def vision_tower():
        output = model.model.get_image_features(pixels, grids)
        torch.cat(output.pooler_output).float().sum().backward()

    def language_model(ranks: int):
        length = row_length // ranks
        embeds = torch.randn(1, length, width, requires_grad=True)
        positions = torch.arange(length)[None].expand(3, 1, length)
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions, use_cache=False)
        hidden.last_hidden_state.sum().backward()

    all_images = timed(vision_tower, options.repeats)
    result = {
        "provenance": run_provenance(
            vars(options), shlex.join(["python", "tools/measure/measure_vision_split.py", *(argv or sys.argv[1:])])
        ),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": 1,
        "cores": os.cpu_count(),
        "row_length": row_length,
        "images": len(grids),
        "image_tokens": image_tokens,
        "vision_all_images_s": all_images,
        "by_ranks": {},
    }
    for ranks in options.ranks:
        dealt = dealt_seconds(ranks, options)
        chunk = timed(lambda ranks=ranks: language_model(ranks), options.repeats)
        result["by_ranks"][ranks] = {
            "vision_dealt_s": dealt,
            "language_model_chunk_s": chunk,
            "all_images_step_s": all_images + chunk,
            "dealt_images_step_s": dealt + chunk,
            "gathered_bytes_fp32": image_tokens * width * 4,
            "processes_over_cores": ranks > (os.cpu_count() or 1),
        }
    print(json.dumps(result, indent=1))
    if options.output:
        Path(options.output).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
