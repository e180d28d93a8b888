"""The precisions `trl-padfree bench` times a step in: the dtype the models are built in, and whether the step runs
under bf16 autocast. Padded TRL and every padding-free mode of a row run in the same precision.

- `trl_default`: float32 weights under bf16 autocast, what TRL 1.16 users run by default (`DPOConfig.bf16=True`, a
  model loaded in float32). Attention then gets float32 queries and keys; the packed forward casts them to bf16 for
  the varlen kernel, as transformers' flash integration does.
- `bf16`: weights in bf16, no autocast (a model loaded with `dtype=torch.bfloat16`).
- `float32`: float32 weights, no autocast: the CPU default, where bf16 matmuls are slow without bf16 instructions
  and no kernel runs anyway. On CUDA such a step runs each sequence's attention apart (the kernel takes half
  precision only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BenchPrecision:
    name: str
    weights: torch.dtype  # the dtype the models are built in
    bf16_autocast: bool  # DPOConfig(bf16=...): the step runs under bf16 autocast


PRECISIONS = {
    "trl_default": BenchPrecision("trl_default", torch.float32, bf16_autocast=True),
    "bf16": BenchPrecision("bf16", torch.bfloat16, bf16_autocast=False),
    "float32": BenchPrecision("float32", torch.float32, bf16_autocast=False),
}
BOTH = ("trl_default", "bf16")
PRECISION_CHOICES = ("both", *PRECISIONS)


def bench_precisions(requested: str | None, device: torch.device) -> list[BenchPrecision]:
    """The precisions `--precision` names (`both`: TRL's default, then bf16 weights); by default both on CUDA, and
    float32 on CPU."""
    requested = requested or ("both" if device.type == "cuda" else "float32")
    names = BOTH if requested == "both" else (requested,)
    return [PRECISIONS[name] for name in names]
