"""Measure what each rank of a split vision-language row spends on the vision tower, on CPU, for the choice of how the
tower runs under sequence and context parallelism (docs/vision-language.md, "Long rows").

Run from the repository root, on a quiet machine:

    python3 tests/measure_vision_split.py --output docs/bench/vision_split_cpu.json

A Qwen2.5-VL built locally (`--text-width`, `--vision-width`, 4 layers each), one packed row of the shipped
conversational pairs with `--images` noise images per prompt, the images resized to about `--image-tokens` tokens
each. On one CPU thread (a rank's share of the machine), medians of `--repeats` after 2 warm-ups, forward and
backward each:

- vision tower, all images: what every rank of the row runs today (`language_model_on_chunk`);
- vision tower, 1/ranks of the images: what each rank would run if the row's images were dealt over its ranks and
  their features all-gathered;
- language model, 1/ranks of the row: each rank's chunk, from embeddings to the last hidden state.

The all-gather the second choice would add (every image token's features, `tokens x width` floats, in the forward
and its reduce-scatter in the backward) is given in bytes, not timed: on gloo over CPU it is not what a GPU link does.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_vision import make_vision_model, make_vision_processor, vision_preference_rows  # noqa: E402

from trl_padfree.packing.vision import PaddingFreeVisionPreferenceCollator  # noqa: E402


def timed(function, repeats: int) -> float:
    for _ in range(2):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    batch = collator(rows)
    images = batch["image_inputs"]
    pixels, grids = images["pixel_values"], images["image_grid_thw"]
    row_length = batch["input_ids"].shape[1]
    image_tokens = int((batch["input_ids"] == model.config.image_token_id).sum())

    def vision_tower(count: int):
        patches = int(grids[:count].prod(-1).sum())
        features = model.model.visual(pixels[:patches], grid_thw=grids[:count]).pooler_output
        features.float().sum().backward()

    def language_model(ranks: int):
        length = row_length // ranks
        embeds = torch.randn(1, length, width, requires_grad=True)
        positions = torch.arange(length)[None].expand(3, 1, length)
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions, use_cache=False)
        hidden.last_hidden_state.sum().backward()

    all_images = timed(lambda: vision_tower(len(grids)), options.repeats)
    result = {
        "command": " ".join(["python3", "tests/measure_vision_split.py", *(argv or sys.argv[1:])]),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": 1,
        "row_length": row_length,
        "images": len(grids),
        "image_tokens": image_tokens,
        "vision_all_images_s": all_images,
        "by_ranks": {},
    }
    for ranks in options.ranks:
        share = timed(lambda ranks=ranks: vision_tower(max(1, len(grids) // ranks)), options.repeats)
        chunk = timed(lambda ranks=ranks: language_model(ranks), options.repeats)
        result["by_ranks"][ranks] = {
            "vision_share_s": share,
            "language_model_chunk_s": chunk,
            "all_images_step_s": all_images + chunk,
            "dealt_images_step_s": share + chunk,
            "gather_bytes_fp32": image_tokens * width * 4,
        }
    print(json.dumps(result, indent=1))
    if options.output:
        Path(options.output).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
