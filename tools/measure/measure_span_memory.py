"""Measure what one attention layer keeps for its backward, and its peak memory, on a sequence holding Gemma 3's
images, at Gemma 3 27B's heads (32 query heads, 16 key-value heads, head dim 128), in bf16, on the CPU.

Run from the repository root: `python tools/measure/measure_span_memory.py`. docs/guides/vision-language.md records
the figures.

The sequences: one with 8 images (256 text tokens, then 8 images of 256 tokens each with 16 text tokens after each:
2,432 tokens, 2,048 of them image tokens), and one of the same length with one image after 256 text tokens, as most
preference pairs have (RLAIF-V's): one sequence of a packed row each. Four ways to attend it:

    explicit   the per-segment path trl-padfree ran before: Gemma 3's mask written out, a float32 heads x T x T
               score matrix (and its softmax) kept for the backward
    pieces     the two-call layout (modeling/attention/bidirectional.py) on the CPU path: sdpa per piece
    padded     TRL's padded step: sdpa over the sequence with Gemma 3's dense (T x T) mask
    kernel     (computed, not measured: no GPU here) the two varlen calls on CUDA keep their gathered inputs, the
               output and a float32 log-sum-exp per query and head

Each case runs in a fresh process; "saved" sums the bytes of the distinct storages autograd keeps for the backward,
"peak" is the process's peak resident memory over the same process before the layer ran (ru_maxrss).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

HEADS, KV_HEADS, HEAD_DIM = 32, 16, 128
TEXT_BEFORE, IMAGE_TOKENS, TEXT_AFTER = 256, 256, 16
LENGTH = TEXT_BEFORE + 8 * (IMAGE_TOKENS + TEXT_AFTER)  # 2,432 tokens, as the 8-image sequence has


def layout(images: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    spans, position = [], TEXT_BEFORE
    for _ in range(images):
        spans.append((position, position + IMAGE_TOKENS))
        position += IMAGE_TOKENS + TEXT_AFTER
    return LENGTH, tuple(spans)


def gemma3_mask(length: int, spans) -> torch.Tensor:
    position = torch.arange(length)
    span_id = torch.full((length,), -1)
    for index, (start, end) in enumerate(spans):
        span_id[start:end] = index
    same_span = (span_id.unsqueeze(1) == span_id.unsqueeze(0)) & (span_id.unsqueeze(1) >= 0)
    return (position.unsqueeze(0) <= position.unsqueeze(1)) | same_span


def run_case(case: str, images: int) -> dict:
    from trl_padfree.modeling.attention.bidirectional import SpanAttention
    from trl_padfree.modeling.attention.rows import PackedRow
    from trl_padfree.modeling.attention.segments import explicit_attention
    from trl_padfree.packing.layout import cu_seq_lens_from_lengths

    length, spans = layout(images)
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, HEADS, length, HEAD_DIM), (1, KV_HEADS, length, HEAD_DIM), (1, KV_HEADS, length, HEAD_DIM)]
    query, key, value = (torch.randn(shape, generator=generator).bfloat16().requires_grad_() for shape in shapes)
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if case == "explicit":
            explicit_attention(query, key, value, gemma3_mask(length, spans), None, 0.0)
        elif case == "pieces":
            bounds = (0, length)
            spans_layout = SpanAttention.of_row([[(0, length)]], bounds, spans, torch.device("cpu"))
            row = PackedRow(cu_seq_lens_from_lengths([length]), length, spans=spans_layout, bounds=bounds)
            options = dict(scaling=None, sliding_window=None, dropout=0.0, softcap=None, sinks=None)
            row.attend(query, key, value, row.cu_seq_lens, length, options)
        else:  # padded
            torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=gemma3_mask(length, spans), enable_gqa=True
            )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    inputs = {tensor.untyped_storage().data_ptr() for tensor in (query, key, value)}
    saved = sum(nbytes for pointer, nbytes in storages.items() if pointer not in inputs)
    return {"case": case, "images": images, "saved_mib": saved / 2**20, "peak_mib": (peak - before) / 1024}


def kernel_estimate(images: int) -> dict:
    """The two varlen calls on CUDA: gathered queries (every query once), gathered keys and values (each piece's
    keys: its sequence up to the piece's end), bf16 outputs, a float32 log-sum-exp per query and head."""
    length, spans = layout(images)
    piece_ends = [end for start, end in spans] + [start for start, end in spans] + [length]
    keys = sum(piece_ends)
    element = 2  # bf16
    saved = (
        2 * length * HEADS * HEAD_DIM * element  # gathered queries, outputs
        + 2 * keys * KV_HEADS * HEAD_DIM * element  # gathered keys and values
        + length * HEADS * 4  # log-sum-exp
    )
    return {"case": "kernel (computed)", "images": images, "saved_mib": saved / 2**20, "peak_mib": None}


def main():
    if len(sys.argv) > 1:  # one case, in its own process
        print(json.dumps(run_case(sys.argv[1], int(sys.argv[2]))))
        return
    print(
        f"{LENGTH} tokens; {HEADS} heads, {KV_HEADS} key-value heads, head dim {HEAD_DIM}, bf16 (torch {torch.__version__})"
    )
    print(f"{'images':>6} {'case':20} {'saved for backward (MiB)':>26} {'peak (MiB)':>12}")
    for images in (8, 1):
        rows = []
        for case in ("explicit", "pieces", "padded"):
            command = [sys.executable, __file__, case, str(images)]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        rows.append(kernel_estimate(images))
        for row in rows:
            peak = "" if row["peak_mib"] is None else f"{row['peak_mib']:.0f}"
            print(f"{images:>6} {row['case']:20} {row['saved_mib']:26.1f} {peak:>12}", flush=True)


if __name__ == "__main__":
    main()
