"""`trl-padfree bench`: padded TRL vs padding-free DPO training steps, side by side on the same batches.

A step is what `Trainer.training_step` does: the reference forward, the policy forward and backward, through the real
`DPOTrainer` of each mode (padded TRL, and padding-free with each attention backend and with prefix sharing), in the
precision users train in (`--precision`). The command line is command.py; the text bench is rows.py (timing, kernel
calls) and report.py (tables, JSON, plot); harness.py holds what every bench shares (length distributions, bench
models, the timed step), precision.py the precisions; `--batching` is budget.py, `--vision` vision.py.
See docs/benchmarks.md.
"""

from .command import add_arguments, run
from .harness import DISTRIBUTIONS, MODEL_SHAPES
from .precision import PRECISIONS, BenchPrecision, bench_precisions
from .rows import PREFIX_SHARING, PREFIX_SHARING_AUTO, ROW_KEYS, BenchRow, bench_trainers, build_trainers, run_bench

__all__ = [
    "DISTRIBUTIONS",
    "MODEL_SHAPES",
    "PRECISIONS",
    "PREFIX_SHARING",
    "PREFIX_SHARING_AUTO",
    "ROW_KEYS",
    "BenchPrecision",
    "BenchRow",
    "add_arguments",
    "bench_precisions",
    "bench_trainers",
    "build_trainers",
    "run",
    "run_bench",
]
