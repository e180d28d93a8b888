"""Measure, for vision-language families at their real head dims (tests/integration/vision/test_vision_kernels.py's `real_head_dims`),
how far one packed step through the strict stand-ins of torch 2.15's `varlen_attn` moves from TRL's padded vision
step in TRL's default precision (float32 weights under bf16 autocast), beside how far TRL's padded step moves from
itself between its `sdpa` and `eager` attention (the noise floor of that precision), as
tools/measure/measure_precision_noise.py does for text models.

Run from the repository root: `python tools/measure/measure_vision_precision_noise.py [FAMILY ...]`. Columns: loss
(absolute), gradients (largest difference over max(1, largest gradient)), metrics (relative to max(1, |value|)); the
per-family gradient bounds of test_vision_kernels.py are set from what it prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers

import conftest  # noqa: E402,F401  (offline, quiet progress bars)
from measure_precision_noise import differences  # noqa: E402
from test_vision_kernels import (  # noqa: E402
    KERNEL_FAMILIES,
    SLOW_KERNEL_FAMILIES,
    TRL_DEFAULT,
    packed_step_through_stand_ins,
    real_head_dims,
)
from tiny_vision import MINICPM_FAMILIES, make_vision_trainer, vision_preference_rows  # noqa: E402
from trainer_utils import one_step  # noqa: E402

SEEDS = (0, 1, 2)  # the test's rows (seed 0), and two other draws of them


def main(families: list[str]) -> None:
    print(f"{'family':22} seed {'sdpa vs eager (loss, grad, metric)':36} packed vs sdpa        packed vs eager")
    for model_type in families:
        for seed in SEEDS:
            data = vision_preference_rows(model_type, 8, seed=seed, images_per_row=(1, 2, 1, 1))
            options = dict(TRL_DEFAULT.trainer_options, model_overrides=real_head_dims(model_type))
            eager = one_step(make_vision_trainer(model_type, False, data, attn_implementation="eager", **options))
            _, sdpa, packed = packed_step_through_stand_ins(
                model_type, data, options, mixers=model_type in MINICPM_FAMILIES
            )
            columns = [differences(sdpa, eager), differences(sdpa, packed), differences(eager, packed)]
            cells = "   ".join(" ".join(f"{value:9.2g}" for value in column) for column in columns)
            print(f"{model_type:22} {seed:4} {cells}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(KERNEL_FAMILIES + SLOW_KERNEL_FAMILIES))
