"""`trl-padfree bench`'s command line: its options (`add_arguments`) and `run`, which picks the text bench (rows.py),
`--batching` (budget.py) or `--vision` (vision.py) and writes the tables, JSON and plot (report.py)."""

from __future__ import annotations

import argparse

import datasets

from ...tiny import DEMO_MODEL_SIZES
from .budget import format_batching_table, run_batching_bench
from .harness import DEFAULT_DISTRIBUTIONS, DISTRIBUTIONS, MODEL_SHAPES
from .precision import PRECISION_CHOICES
from .report import format_conditions, format_step_table, format_table, plot, write_rows
from .rows import (
    CPU_STEPS,
    CPU_WARMUP,
    GPU_STEPS,
    GPU_WARMUP,
    QUICK_STEPS,
    SHARING_CHOICES,
    run_bench,
    set_step_counts,
)
from .vision import VISION_MAX_WORDS, VISION_MODEL_SHAPES, format_vision_table, run_vision_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny model, few batches: a few minutes on 2 CPU cores")
    parser.add_argument(
        "--model",
        default=None,
        help=f"{sorted(DEMO_MODEL_SIZES)} (demo llama) or a public model's shape with random weights, no download: "
        f"{sorted(MODEL_SHAPES)} (default: small, tiny with --quick)",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISION_CHOICES,
        default=None,
        help="trl_default: float32 weights under bf16 autocast, TRL's default (DPOConfig.bf16=True, the model loaded "
        "in float32); bf16: weights in bf16, no autocast; both: the two, each mode against padded TRL in the same "
        "precision; float32: float32 weights, no autocast (default: both on CUDA; float32 on CPU, the CPU figures' "
        "precision and the fast one there: bf16 matmuls are slow on CPUs without bf16 instructions)",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="train LoRA adapters (peft, rank 16, every linear layer) instead of every weight; the reference is the "
        "policy with its adapters off, no second model: how an 8B model's step fits one GPU",
    )
    parser.add_argument(
        "--distributions",
        nargs="+",
        choices=DISTRIBUTIONS,
        default=list(DEFAULT_DISTRIBUTIONS),
        help="length distributions to draw pairs from: ultrafeedback (single-turn chat, short prompts), capybara "
        "(multi-turn, long prompts), shipped (the shipped data's exact lengths), prompt_groups (capybara's prompts "
        "with 4 completions each, paired all ways: 6 consecutive pairs per prompt) (default: the first three)",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=None,
        help="padding-free attention backends to time (default: padfree_varlen and sdpa on CPU; padfree_varlen, "
        "flash_attention_2 where flash-attn is installed, and sdpa on CUDA)",
    )
    parser.add_argument(
        "--steps",
        "--batches",
        dest="batches",
        metavar="N",
        type=int,
        default=None,
        help=f"measured steps (batches) per mode and distribution (default: {GPU_STEPS} on CUDA, {CPU_STEPS} on CPU, "
        f"{QUICK_STEPS} with --quick)",
    )
    parser.add_argument(
        "--warmup",
        metavar="N",
        type=int,
        default=None,
        help=f"untimed warm-up steps per mode (default: {GPU_WARMUP} on CUDA, {CPU_WARMUP} on CPU)",
    )
    parser.add_argument("--pairs-per-batch", type=int, default=8, help="preference pairs per step (default: 8)")
    parser.add_argument(
        "--max-length", type=int, default=1024, help="per-sequence truncation, as TRL's max_length (default: 1024)"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--no-activation-checkpointing",
        dest="activation_checkpointing",
        action="store_false",
        help="run every mode without activation checkpointing (default: on, as TRL's DPOConfig has it; the text "
        "bench and --batching)",
    )
    parser.add_argument(
        "--prefix-sharing",
        choices=SHARING_CHOICES,
        default="both",
        help="prefix-sharing rows timed next to padfree_varlen: true (prefix_sharing=True), auto (each batch shared "
        "or not, as the cost model says), both, or none (default: both)",
    )
    parser.add_argument(
        "--no-prefix-sharing",
        dest="prefix_sharing",
        action="store_const",
        const="none",
        help="skip the prefix-sharing rows (the same as --prefix-sharing none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn lengths and tokens (default: 0)")
    parser.add_argument(
        "--batching",
        action="store_true",
        help="instead: fixed pairs per micro-batch vs token-budget micro-batches at the same peak row length, "
        "padding-free both (tokens/s, optimizer steps per epoch)",
    )
    parser.add_argument(
        "--vision",
        action="store_true",
        help="instead: a Qwen2.5-VL-shaped model on pairs with one image each (--model qwen2.5-vl-demo, the default, "
        "or qwen2.5-vl-3b): padded vs padding-free vs prefix sharing, with the images each mode encodes",
    )
    parser.add_argument("--output", metavar="FILE.json", help="write the rows as a JSON list")
    parser.add_argument("--plot", metavar="FILE.png", help="plot speedup vs ideal per distribution")
    parser.set_defaults(run=run)


def run(options: argparse.Namespace) -> int:
    options.model = options.model or ("qwen2.5-vl-demo" if options.vision else "tiny" if options.quick else "small")
    set_step_counts(options)
    if options.vision and (options.model not in VISION_MODEL_SHAPES or options.batching or options.plot):
        raise ValueError(f"--vision runs on --model {' or '.join(VISION_MODEL_SHAPES)}, without --batching or --plot.")
    if (options.vision or options.batching) and (options.precision or options.lora):
        raise ValueError(
            "--precision and --lora apply to the text bench; --vision and --batching build their models in bf16 on "
            "CUDA and float32 on CPU, every weight trained."
        )
    datasets.disable_progress_bars()
    if options.vision:
        options.max_words = VISION_MAX_WORDS
        rows = run_vision_bench(options)
        print(format_vision_table(rows))
    elif options.batching:
        rows = run_batching_bench(options)
        print(format_batching_table(rows))
    else:
        rows = run_bench(options)
        print(format_conditions(rows) + "\n\n" + format_table(rows) + "\n\n" + format_step_table(rows))
    if options.output:
        write_rows(rows, options.output, vars(options))
    if options.plot and not options.batching:
        plot(rows, options.plot)
    return 0
