"""`trl-padfree demo`: padded TRL and padding-free DPO on the same batches, and what packing saved.

Everything is local: a demo model built from a config (`trl_padfree.tiny`), the preference data and tokenizer shipped
in the package (`trl_padfree.data`). Both runs start from the same weights, see the same batches in the same order
and use the same optimizer, so their losses must agree step for step; only the time differs.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass

import datasets
from tqdm.auto import tqdm
from transformers import ProgressCallback, TrainerCallback

from ..config import DPOConfig
from ..data import load_demo_dataset, load_demo_tokenizer
from ..modeling.check.packability import resolve_attn_implementation
from ..tiny import DEMO_MODEL_SIZES, TINY_CONFIGS, make_demo_model
from ..trainer import DPOTrainer

PACKED_ATTN_CHOICES = ("auto", "padfree_varlen", "sdpa", "eager")


@dataclass
class ModeResult:
    losses: list[float]
    step_seconds: list[float]  # wall time of each optimizer step
    real_tokens: int  # TRL's own count (attention mask sum), over all steps


@dataclass
class DemoReport:
    model: str
    steps: int
    pairs_per_step: int
    packed_attn_implementation: str
    real_tokens: int
    padded_tokens: int
    padding_removed: float
    padded_tokens_per_s: float
    padfree_tokens_per_s: float
    speedup: float
    ideal_speedup: float
    padded_final_loss: float
    padfree_final_loss: float
    max_loss_diff: float
    prefix_sharing: bool = False
    shared_tokens: int = 0  # prompt tokens computed once instead of twice (prefix sharing)

    def format(self) -> str:
        padfree = self.packed_attn_implementation + (", prefix sharing" if self.prefix_sharing else "")
        ideal = "padded / row tokens" if self.prefix_sharing else "padded / real tokens"
        rows = [
            ("model", f"{self.model}, {self.steps} steps of {self.pairs_per_step} pairs"),
            ("real tokens", f"{self.real_tokens:,}"),
            ("padded tokens (TRL)", f"{self.padded_tokens:,}"),
            ("padding removed", f"{self.padding_removed:.1%}"),
            ("tokens/s padded", f"{self.padded_tokens_per_s:,.0f}"),
            (f"tokens/s padding-free ({padfree})", f"{self.padfree_tokens_per_s:,.0f}"),
            ("speedup", f"{self.speedup:.2f}x (ideal {self.ideal_speedup:.2f}x = {ideal})"),
            ("final loss padded", f"{self.padded_final_loss:.6f}"),
            ("final loss padding-free", f"{self.padfree_final_loss:.6f}"),
            ("largest loss difference", f"{self.max_loss_diff:.1e} over all steps"),
        ]
        if self.prefix_sharing:
            rows.insert(4, ("prompt tokens shared", f"{self.shared_tokens:,}"))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


class _StepTimer(TrainerCallback):
    def __init__(self):
        self.step_seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self._start)


class _ProgressBar(TrainerCallback):
    """One bar per run with the last loss, instead of the Trainer's bar that prints every log line."""

    def __init__(self, description: str):
        self.description = description

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(total=state.max_steps, desc=self.description, unit="step", dynamic_ncols=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}")

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(1)

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def _train(padding_free: bool, options: argparse.Namespace, output_dir: str) -> tuple[ModeResult, list[dict]]:
    dataset = load_demo_dataset("train")
    config = DPOConfig(
        output_dir=output_dir,
        padding_free=padding_free,
        packed_attn_implementation=options.attn_implementation,
        prefix_sharing=padding_free and options.prefix_sharing,
        per_device_train_batch_size=options.batch_size,
        max_steps=options.steps,
        max_length=options.max_length,
        learning_rate=options.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,  # fp32 on CPU: the two runs agree to rounding noise
        activation_checkpointing=False,  # small activations; transformers' new name, so no deprecation warning
        use_cpu=True,
        seed=options.seed,
        data_seed=options.seed,
        dataloader_num_workers=0,
    )
    model = make_demo_model(options.size, options.model_type, seed=options.seed)
    ref_model = make_demo_model(options.size, options.model_type, seed=options.seed)
    timer = _StepTimer()
    trainer = DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=config,
        train_dataset=dataset,
        processing_class=load_demo_tokenizer(),
        callbacks=[timer],
    )
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_ProgressBar("padding-free" if padding_free else "padded TRL  "))
    trainer.train()
    history = trainer.state.log_history
    steps = [entry for entry in history if "loss" in entry]
    result = ModeResult(
        losses=[entry["loss"] for entry in steps],
        step_seconds=timer.step_seconds,
        real_tokens=int(steps[-1]["num_tokens"]),
    )
    return result, steps


def run_demo(options: argparse.Namespace) -> DemoReport:
    """Train padded, then padding-free, on the same batches; compare tokens/s and losses."""
    with tempfile.TemporaryDirectory(prefix="trl-padfree-demo-") as output_dir:
        padded, _ = _train(False, options, output_dir)
        padfree, padfree_steps = _train(True, options, output_dir)
    if padded.real_tokens != padfree.real_tokens:
        raise RuntimeError(f"The runs saw different tokens ({padded.real_tokens} vs {padfree.real_tokens}).")
    real_per_step = [entry["padfree/real_tokens"] for entry in padfree_steps]
    padded_per_step = [entry["padfree/padded_tokens"] for entry in padfree_steps]
    # The first step pays one-off costs (allocations, lazy inits) in both modes: time the steps after it
    timed = slice(1, None) if options.steps > 1 else slice(None)
    timed_real_tokens = sum(real_per_step[timed])
    padded_speed = timed_real_tokens / sum(padded.step_seconds[timed])
    padfree_speed = timed_real_tokens / sum(padfree.step_seconds[timed])
    real_tokens, padded_tokens = int(sum(real_per_step)), int(sum(padded_per_step))
    shared_tokens = int(sum(entry.get("padfree/shared_tokens", 0) for entry in padfree_steps))
    return DemoReport(
        model=f"{options.size}-{options.model_type}",
        steps=options.steps,
        pairs_per_step=options.batch_size,
        packed_attn_implementation=resolve_attn_implementation(
            options.attn_implementation, "sdpa", options.prefix_sharing
        ),
        real_tokens=real_tokens,
        padded_tokens=padded_tokens,
        padding_removed=1 - real_tokens / padded_tokens,
        padded_tokens_per_s=padded_speed,
        padfree_tokens_per_s=padfree_speed,
        speedup=padfree_speed / padded_speed,
        ideal_speedup=padded_tokens / (real_tokens - shared_tokens),
        padded_final_loss=padded.losses[-1],
        padfree_final_loss=padfree.losses[-1],
        max_loss_diff=max(abs(a - b) for a, b in zip(padded.losses, padfree.losses, strict=True)),
        prefix_sharing=options.prefix_sharing,
        shared_tokens=shared_tokens,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=sorted(DEMO_MODEL_SIZES), default="small", help="demo model size")
    parser.add_argument("--model-type", choices=sorted(TINY_CONFIGS), default="llama", help="architecture")
    parser.add_argument("--steps", type=_positive_int, default=20, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="preference pairs per step")
    parser.add_argument(
        "--attn-implementation",
        choices=PACKED_ATTN_CHOICES,
        default="auto",
        help="attention of the padding-free run (the padded run uses sdpa); auto = padfree_varlen here",
    )
    parser.add_argument(
        "--prefix-sharing", action="store_true", help="the padding-free run computes each prompt once (prefix_sharing)"
    )
    parser.add_argument("--max-length", type=_positive_int, default=1024, help="TRL's max_length (truncation)")
    parser.add_argument(
        "--learning-rate", type=float, default=1e-3, help="of both runs (default: 1e-3, high: the model starts random)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the model's weights and the data order (default: 0)")
    parser.add_argument("--report", metavar="FILE.json", help="also write the report as JSON")
    parser.set_defaults(run=run)


def run(options: argparse.Namespace) -> int:
    # Two progress bars and the report; the per-example bars of dataset preparation would drown them
    datasets.disable_progress_bars()
    report = run_demo(options)
    print("\nPadded TRL vs padding-free DPO, same batches:\n" + report.format())
    if options.report:
        with open(options.report, "w") as file:
            json.dump(asdict(report), file, indent=2)
    return 0 if math.isfinite(report.max_loss_diff) else 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value
