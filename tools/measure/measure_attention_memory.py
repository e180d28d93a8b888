"""What one attention layer keeps for the backward on a 4K-token packed row of two 2K sequences, per path, against
padded TRL with the kernel its users pick (docs/concepts/kernels.md, "Memory").

Run from the repository root:
`python tools/measure/measure_attention_memory.py [--out docs/bench/attention_memory.json]`.

Two kinds of figures, each marked in the output:
- measured: one call of the layer's attention in TRL's default precision (float32 queries and keys, bf16 values,
  under bf16 autocast), every tensor autograd saves counted once (`saved_tensors_hooks`, by storage). The per-segment
  path runs on CPU as on a GPU; the sink correction runs its own code around the varlen stand-in (the kernel's call
  happens inside the correction's forward, so what is counted is the correction's saves, which are what it keeps);
- documented: the kernels' own saves, from their sources: Flash (torch's `_varlen_attn` op `_setup_context`,
  flash-attn's `FlashAttnVarlenFunc`, FA3's): query, key, value, output in bf16 and a float32 log-sum-exp per query
  and head; the memory-efficient kernel (`_efficient_attention_forward`'s derivative): the same with keys and values
  expanded to the query heads and a log-sum-exp padded to 32 rows per segment; FlexAttention: the same as Flash, plus
  its block mask (a few KiB).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers

from stand_in_kernels import varlen_stand_in  # noqa: E402

from trl_padfree.cli.bench.report import run_provenance
from trl_padfree.modeling.attention.interface import padfree_varlen_attention  # noqa: E402
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.packing.layout import cu_seq_lens_from_lengths  # noqa: E402

LENGTHS = (2048, 2048)
MIB = 2**20
BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Layer:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    options: dict
    padded_kernel: str  # what padded TRL users run it on


LAYERS = (
    Layer("GPT-OSS-20B (sinks)", 64, 8, 64, dict(sinks=True), "kernels-hub FlashAttention-3 (`s_aux`)"),
    Layer("Gemma 2 9B (softcap 50)", 16, 8, 256, dict(softcap=50.0), "flash-attn 2 (`softcap`)"),
    Layer(
        "Gemma 4 global layer (head dim 512)", 8, 4, 512, dict(), "sdpa, keys and values repeated: memory-efficient"
    ),
)


def flash_saves(tokens: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Query, key, value and output in bf16, a float32 log-sum-exp per query and head."""
    return tokens * head_dim * BF16 * (2 * heads + 2 * kv_heads) + tokens * heads * FP32


def efficient_saves(tokens: int, heads: int, head_dim: int, segments: int, longest: int) -> int:
    """Keys and values expanded to the query heads; log-sum-exp padded to 32 rows per segment."""
    return tokens * head_dim * BF16 * 4 * heads + segments * heads * math.ceil(longest / 32) * 32 * FP32


def saved_bytes(function) -> int:
    """Bytes of the tensors autograd saves while `function()` runs, each storage counted once."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(storages.values())


def attention_inputs(layer: Layer):
    """TRL's default precision: float32 queries and keys (RoPE's float32 cos/sin), bf16 values."""
    tokens = sum(LENGTHS)
    generator = torch.Generator().manual_seed(0)

    def tensor(heads, dtype):
        return torch.randn(1, heads, tokens, layer.head_dim, generator=generator).to(dtype).requires_grad_()

    query, key = tensor(layer.heads, torch.float32), tensor(layer.kv_heads, torch.float32)
    value = tensor(layer.kv_heads, torch.bfloat16)
    options = dict(layer.options)
    if options.pop("sinks", False):
        options["s_aux"] = torch.zeros(layer.heads, requires_grad=True)
    cu_seq_lens = cu_seq_lens_from_lengths(list(LENGTHS))
    call = dict(scaling=layer.head_dim**-0.5, cu_seq_lens_q=cu_seq_lens, max_length_q=max(LENGTHS), **options)
    return (query, key, value), call


def measure(layer: Layer) -> dict:
    inputs, call = attention_inputs(layer)
    module = torch.nn.Module()

    def attend():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            padfree_varlen_attention(module, *inputs, None, **call)

    per_segment = saved_bytes(attend)  # the CPU path: what the CUDA path ran for these layers without a fused kernel
    tokens, segments, longest = sum(LENGTHS), len(LENGTHS), max(LENGTHS)
    flash = flash_saves(tokens, layer.heads, layer.kv_heads, layer.head_dim)
    row = dict(layer=layer.name, tokens=tokens, heads=layer.heads, kv_heads=layer.kv_heads, head_dim=layer.head_dim)
    row["per_segment_measured_mib"] = per_segment / MIB
    if "sinks" in layer.options:
        with stand_in_kernels(varlen=varlen_stand_in("2.15")):
            fused = saved_bytes(attend)
        row.update(fused_kernel="torch varlen + sink correction", fused_mib=fused / MIB, fused_kind="measured")
        row.update(padded_mib=flash / MIB, padded_kind="documented")
    elif "softcap" in layer.options:
        row.update(fused_kernel="flash-attn varlen (softcap) or FlexAttention", fused_mib=flash / MIB)
        row.update(fused_kind="documented", padded_mib=flash / MIB, padded_kind="documented")
    else:
        # On CUDA a segment's sdpa with grouped heads at head dim 512 runs the math backend (flash: at most 256;
        # memory-efficient: no grouped heads; cuDNN: at most 128), which keeps float32 copies of the query and the
        # repeated key and value and the float32 softmax; on CPU sdpa runs its flash kernel, hence the measured figure
        math = sum(layer.heads * length * (length + 3 * layer.head_dim) * FP32 for length in LENGTHS)
        row.update(per_segment_cuda_mib=math / MIB, per_segment_cuda_kind="documented (sdpa's math backend)")
        wide = efficient_saves(tokens, layer.heads, layer.head_dim, segments, longest)
        row.update(fused_kernel="torch memory-efficient (varlen)", fused_mib=wide / MIB, fused_kind="documented")
        # Padded: two rows of 2K, keys and values repeated by transformers, a (2, 1, 2K, 2K) bf16 mask saved too
        row.update(padded_mib=(wide + 2 * longest * longest * BF16) / MIB, padded_kind="documented")
    row["padded_kernel"] = layer.padded_kernel
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = [measure(layer) for layer in LAYERS]
    print("| Layer | Per segment (measured) | Fused kernel | Fused | Padded TRL's kernel | Padded |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        per_segment = f"{row['per_segment_measured_mib']:,.0f} MiB"
        if "per_segment_cuda_mib" in row:
            per_segment = f"{row['per_segment_cuda_mib']:,.0f} MiB on CUDA (math backend); {per_segment} on CPU"
        print(
            f"| {row['layer']} | {per_segment} | {row['fused_kernel']} | "
            f"{row['fused_mib']:,.0f} MiB ({row['fused_kind']}) | {row['padded_kernel']} | "
            f"{row['padded_mib']:,.0f} MiB ({row['padded_kind']}) |"
        )
    if args.out is not None:
        report = dict(provenance=run_provenance(vars(args)), rows=rows)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
