"""The sink correction's cost and exactness (docs/concepts/kernels.md, "Sinks"): bytes moved per output element,
forward and backward, and its error against float64, for the correction as shipped (its products in the kernel's
dtype, rounded once) and for the same correction computed entirely in float32 (every bf16 tensor cast up and back).

Run from the repository root: `python tools/measure/measure_sink_correction.py [--out FILE]`.

Both run around torch 2.15's varlen stand-in (tests/support/stand_in_kernels.py: FA2's bf16 numbers) on GPT-OSS-20B's
attention (64 query heads over 8 key/value heads, head dim 64), bf16, with a bf16 incoming gradient. Bytes are
counted by tests/modeling/attention/test_sink_correction.py's `TensorTraffic` (its rule in that module's docstring). Errors are against
the correction computed in float64 from the same kernel output, log-sum-exp and gradient: out' and dO elementwise
(relative), the sink's gradient per head (relative to its float64 value, and to sum |rowsum(dout * out')| (1 - w),
the scale its rounding works at).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers

from stand_in_kernels import varlen_stand_in  # noqa: E402
from test_sink_correction import TensorTraffic  # noqa: E402

from trl_padfree.cli.bench.report import run_provenance  # noqa: E402
from trl_padfree.modeling.attention.sinks import varlen_with_sinks  # noqa: E402
from trl_padfree.modeling.kernels.attention import VarlenKernel, flash_backend

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64
# (name, segment lengths, sliding window): GPT-OSS alternates full layers with 128-token windows
SHAPES = [("full, 4 segments", (300, 1, 200, 523), None), ("window 128, 4 segments", (300, 1, 200, 523), 128)]
# (name, scale of the query, sink logits): attention from flat to peaked; sinks from rarely to mostly taken
REGIMES = [
    ("scores std 1, sinks 2 N(0, 1)", 1.0, lambda generator: 2 * torch.randn(HEADS, generator=generator)),
    ("scores std 4, sinks 2 N(0, 1)", 4.0, lambda generator: 2 * torch.randn(HEADS, generator=generator)),
    ("scores std 1, sinks -12 (w near 1)", 1.0, lambda generator: torch.full((HEADS,), -12.0)),
    ("scores std 1, sinks +12 (w near 0)", 1.0, lambda generator: torch.full((HEADS,), 12.0)),
]


class Float32Correction(torch.autograd.Function):
    """The same correction with every step in float32: each bf16 tensor cast up, multiplied, cast back."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, boundaries, max_lengths, kernel, options):
        from torch.nn.attention.varlen import AuxRequest

        output, lse = kernel.function(
            query, key, value, *boundaries, *max_lengths, return_aux=AuxRequest(lse=True), **options
        )
        kept = torch.sigmoid(lse - sinks.float().unsqueeze(1)).t().unsqueeze(-1)
        corrected = (output.float() * kept).to(output.dtype)
        ctx.save_for_backward(query, key, value, *boundaries, corrected, lse, kept)
        ctx.kernel, ctx.options, ctx.max_lengths = kernel, options, max_lengths
        return corrected

    @staticmethod
    def backward(ctx, grad):
        query, key, value, cu_seq_q, cu_seq_k, corrected, lse, kept = ctx.saved_tensors
        window = list(ctx.options["window_size"])
        grad = grad.float()
        grads = ctx.kernel.backward(
            (grad * kept).to(query.dtype), query, key, value, corrected, lse, cu_seq_q, cu_seq_k, *ctx.max_lengths,
            window == [-1, 0], torch.zeros(2, dtype=torch.uint64), ctx.options.get("scale"), window,
        )  # fmt: skip
        grad_sinks = -((grad * corrected.float()).sum(-1, keepdim=True) * (1 - kept)).sum((0, 2))
        return *grads, grad_sinks, None, None, None, None


def shipped(*args):
    return varlen_with_sinks(*args)


def float32(*args):
    return Float32Correction.apply(*args)


def recorded_kernel(record: dict) -> VarlenKernel:
    """torch 2.15's stand-in, keeping what the correction gave its backward op (dO, out') and got from its forward."""
    stand_in = varlen_stand_in("2.15")

    def forward(*args, **kwargs):
        record["output"], record["lse"] = stand_in.function(*args, **kwargs)
        return record["output"], record["lse"]

    def backward(grad_out, *args):
        record["grad_out"], record["corrected"] = grad_out, args[3]
        return stand_in.backward(grad_out, *args)

    return VarlenKernel(forward, stand_in.capability, backward=backward)


def run(correction, lengths, window, query_scale, sink_logits, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    query, key, value = (
        torch.randn(total, heads, HEAD_DIM, generator=generator) for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    query = (query * query_scale).bfloat16().requires_grad_()
    key, value = key.bfloat16().requires_grad_(), value.bfloat16().requires_grad_()
    sinks = sink_logits(generator).requires_grad_()
    grad = torch.randn(total, HEADS, HEAD_DIM, generator=generator).bfloat16()
    cu_seq = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    options = dict(window_size=(-1 if window is None else window - 1, 0), enable_gqa=True, scale=HEAD_DIM**-0.5)
    record = {}
    inputs = (query, key, value, sinks)
    with flash_backend():  # as packed attention calls it
        output = correction(*inputs, (cu_seq, cu_seq), (max(lengths),) * 2, recorded_kernel(record), options)
    grads = torch.autograd.grad(output, inputs, grad)
    return record, output, grads, grad, sinks


def errors(record, output, grads, grad, sinks) -> dict:
    """Against the correction in float64 from the same kernel output, log-sum-exp and gradient."""
    lse, out = record["lse"].double(), record["output"].double()
    kept = torch.sigmoid(lse - sinks.detach().double().unsqueeze(1)).t().unsqueeze(-1)
    exact_output, exact_grad_out = out * kept, grad.double() * kept
    terms = (grad.double() * exact_output).sum(-1, keepdim=True) * (1 - kept)
    exact_grad_sinks = -terms.sum((0, 2))

    def relative(got, exact):
        nonzero = exact != 0
        return float(((got.double() - exact).abs()[nonzero] / exact.abs()[nonzero]).max())

    grad_sinks = grads[3].double()
    return {
        "output_max_relative": relative(output, exact_output),
        "grad_out_max_relative": relative(record["grad_out"], exact_grad_out),
        "grad_sinks_max_relative": relative(grad_sinks, exact_grad_sinks),
        "grad_sinks_max_over_scale": float(((grad_sinks - exact_grad_sinks).abs() / terms.abs().sum((0, 2))).max()),
    }


def traffic(correction, lengths) -> dict:
    """Bytes the correction moves around the kernel, per output element (the kernel's calls not counted)."""
    counter = TensorTraffic()
    stand_in = varlen_stand_in("2.15")

    def uncounted(function):
        def call(*args, **kwargs):
            with counter.kernel():
                return function(*args, **kwargs)

        return call

    kernel = VarlenKernel(uncounted(stand_in.function), stand_in.capability, backward=uncounted(stand_in.backward))
    total = sum(lengths)
    inputs = [torch.randn(total, heads, HEAD_DIM).bfloat16().requires_grad_() for heads in (HEADS, KV_HEADS, KV_HEADS)]
    sinks = torch.randn(HEADS, requires_grad=True)
    cu_seq = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    options = dict(window_size=(-1, 0), enable_gqa=True, scale=HEAD_DIM**-0.5)
    elements = total * HEADS * HEAD_DIM
    with counter, flash_backend():
        output = correction(*inputs, sinks, (cu_seq, cu_seq), (max(lengths),) * 2, kernel, options)
    forward = dict(launches=counter.launches(), bytes_per_element=counter.moved() / elements)
    grad = torch.randn_like(output)
    counter.ops = []
    with counter:
        torch.autograd.grad(output, (*inputs, sinks), grad)
    backward = dict(launches=counter.launches(), bytes_per_element=counter.moved() / elements)
    return dict(forward=forward, backward=backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures to this JSON file")
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    results = {"provenance": run_provenance(vars(arguments)), "bytes": {}, "errors": []}
    for name, correction in (("shipped", shipped), ("float32", float32)):
        results["bytes"][name] = traffic(correction, (37, 1, 90))
        print(name, json.dumps(results["bytes"][name]))
    for shape, lengths, window in SHAPES:
        for regime, query_scale, sink_logits in REGIMES:
            row = {"shape": shape, "regime": regime}
            runs = {}
            for name, correction in (("shipped", shipped), ("float32", float32)):
                runs[name] = run(correction, lengths, window, query_scale, sink_logits)
                row[name] = errors(*runs[name])
            (record, output, grads, _, _), (record_32, output_32, grads_32, _, _) = runs.values()
            # out', dO and so dQ, dK, dV: the same bits either way
            row["bit_equal"] = all(
                torch.equal(mine, theirs)
                for mine, theirs in zip(
                    (output, record["grad_out"], *grads[:3]),
                    (output_32, record_32["grad_out"], *grads_32[:3]),
                    strict=True,
                )
            )
            results["errors"].append(row)
            print(json.dumps(row))
    if arguments.out is not None:
        arguments.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
