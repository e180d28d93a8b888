"""Measure packed-vs-padded differences (loss, gradients, metrics) for every loss type and a few options, in fp32.

Run from the repository root: `python tools/measure/measure_noise.py`. The tolerances in tests/support/tolerances.py are
set at 3-5x the maxima this prints; docs/concepts/exactness.md records the figures.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers

import conftest  # noqa: E402,F401  (offline, quiet progress bars)
from test_trainer import LOSS_TYPES  # noqa: E402
from trainer_utils import make_trainer, one_step  # noqa: E402

CASES = [dict(loss_type=[loss_type]) for loss_type in LOSS_TYPES] + [
    dict(use_weighting=True),
    dict(ld_alpha=0.5),
    dict(f_divergence_type="forward_kl"),
    dict(attn_implementation="eager"),
    dict(packed_attn_implementation="sdpa"),
    dict(model_type="gpt2"),
    dict(model_type="mistral"),
]


def main():
    maxima = {"loss": 0.0, "grad": 0.0, "metric": 0.0}
    print(f"{'case':48} {'loss':>8} {'loss rel':>9} {'grad/max':>9} {'metric rel':>10}")
    for options in CASES:
        padded, packed = one_step(make_trainer(False, **options)), one_step(make_trainer(True, **options))
        largest = max(1.0, max(grad.abs().max().item() for grad in padded.grads.values()))
        loss = abs(padded.loss - packed.loss) / abs(padded.loss)
        grad = max((padded.grads[name] - packed.grads[name]).abs().max().item() for name in padded.grads) / largest
        metric = max(
            abs(padded.metrics[key] - packed.metrics[key]) / max(1.0, abs(padded.metrics[key]))
            for key in padded.metrics
        )
        for key, value in (("loss", loss), ("grad", grad), ("metric", metric)):
            maxima[key] = max(maxima[key], value)
        print(f"{str(options):48} {padded.loss:8.3g} {loss:9.2g} {grad:9.2g} {metric:10.2g}")
    print(
        f"max: loss rel {maxima['loss']:.2g}, gradient / largest {maxima['grad']:.2g}, metric rel {maxima['metric']:.2g}"
    )


if __name__ == "__main__":
    main()
