"""Measure, in the precisions users train in, how far one packed step through the kernel branch (strict stand-ins of
torch 2.15's `varlen_attn`, tests/support/stand_in_kernels.py) moves from TRL's padded step, beside how far TRL's padded step
moves from itself between its `sdpa` and `eager` attention (the noise floor of that precision).

Run from the repository root: `python tools/measure/measure_precision_noise.py [TYPE ...]`. The half-precision bounds
of tests/support/tolerances.py (`HALF` and its per-model tables) are set from what it prints; docs/concepts/exactness.md
records the figures.

Precisions: TRL's default (float32 weights under its `bf16=True` autocast), float32 weights under fp16 autocast, and
bf16 weights without autocast.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers

import conftest  # noqa: E402,F401  (offline, quiet progress bars)
from stand_in_kernels import MIXER_STAND_INS, varlen_stand_in  # noqa: E402
from test_architecture import POPULAR_TYPES  # noqa: E402
from tiny_architectures import HYBRID_MODEL_TYPES, make_tiny_model  # noqa: E402
from tiny_fixtures import make_tokenizer  # noqa: E402
from trainer_utils import HALF, PRECISIONS, make_trainer, one_step  # noqa: E402

from trl_padfree.modeling.check.stand_ins import stand_in_kernels


def differences(reference, other, exempt_metrics=HALF.exempt_metrics) -> tuple[float, float, float]:
    """Loss (absolute), gradients (largest difference over max(1, largest gradient)), metrics (relative to
    max(1, |value|)) but the counts half precision flips (`exempt_metrics`: one near-tie moves them by a whole step)."""
    largest = max(1.0, max(grad.abs().max().item() for grad in reference.grads.values()))
    grad = max((reference.grads[name] - other.grads[name]).abs().max().item() for name in reference.grads) / largest
    metric = max(
        abs(reference.metrics[key] - other.metrics[key]) / max(1.0, abs(reference.metrics[key]))
        for key in reference.metrics
        if key not in exempt_metrics
    )
    return abs(reference.loss - other.loss), grad, metric


def main(types: list[str]):
    vocab_size = len(make_tokenizer())
    print(f"{'type':18} {'precision':13} {'sdpa vs eager (loss, grad, metric)':38} packed vs sdpa")
    maxima = {}
    for model_type in types:

        def build(seed, attn_implementation="sdpa", model_type=model_type):
            model = make_tiny_model(model_type, vocab_size, seed=seed)
            model.config._attn_implementation = attn_implementation
            return model

        for name, precision in PRECISIONS.items():

            def run(padding_free, factory=build, stand_ins=None, precision=precision):
                trainer = make_trainer(
                    padding_free, model_factory=factory, dtype=precision.dtype, **precision.trainer_options
                )
                if stand_ins is None:
                    return one_step(trainer, autocast=precision.autocast)
                with stand_ins:
                    trainer = make_trainer(
                        padding_free, model_factory=factory, dtype=precision.dtype, **precision.trainer_options
                    )
                    return one_step(trainer, autocast=precision.autocast)

            try:
                sdpa = run(False)
                eager = run(False, factory=lambda seed: build(seed, "eager"))
                stand_ins = stand_in_kernels(varlen=varlen_stand_in("2.15"), mixer_kernels=MIXER_STAND_INS)
                packed = run(True, stand_ins=stand_ins)
            except Exception as error:  # a precision a family cannot train in on this CPU
                print(f"{model_type:18} {name:13} failed: {type(error).__name__}: {str(error)[:80]}")
                continue
            floor, ours = differences(sdpa, eager), differences(sdpa, packed)
            for key, value in zip(("loss", "grad", "metric"), ours, strict=True):
                maxima[name, key] = max(maxima.get((name, key), 0.0), value)
            print(
                f"{model_type:18} {name:13} {floor[0]:9.2g} {floor[1]:9.2g} {floor[2]:9.2g}         "
                f"{ours[0]:9.2g} {ours[1]:9.2g} {ours[2]:9.2g}",
                flush=True,
            )
    for name in PRECISIONS:
        print(name, {key: f"{maxima.get((name, key), 0.0):.2g}" for key in ("loss", "grad", "metric")})


if __name__ == "__main__":
    main(sys.argv[1:] or list(POPULAR_TYPES + HYBRID_MODEL_TYPES))
