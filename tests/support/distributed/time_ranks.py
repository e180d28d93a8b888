"""Time each data-parallel process's share of every optimizer step, with and without balanced batches.

One process of a DDP launch (tools/measure/measure_balanced_ranks.py runs it under `accelerate launch` over gloo). For each
`--grad-accum` value it trains `trl_padfree.DPOTrainer` with `padding_free=True` on the shipped preference data twice,
one run after the other with the same seed, model and number of steps: `train_sampling_strategy="random"` (each
process takes `per_device_train_batch_size` consecutive pairs of the shuffled data) and `"batch_rebalance"` (the same
global batches, split so every process's row costs about the same). Rank 0 writes every process's numbers as JSON.

What is timed, per process and per micro-batch (`Trainer.training_step`: forward, loss, backward):

    training_step   |<-- policy + reference forward -->|wait|<---- backward ---->|wait|
                                                        ^                          ^
                          TRL's metric gathers (collectives)       DDP's gradient all-reduce (sync micro-step)

- `seconds`: wall time of the call (`time.perf_counter`).
- `collective_seconds`: wall time inside the torch.distributed collectives Python calls meanwhile (TRL's metric
  gathers, the balanced loss's pair count, DDP's buffer broadcast). A process whose forward ended first waits there.
- `gradient_sync_seconds`: from the last gradient this process accumulated to the end of the call: DDP's all-reduce,
  which waits for the slowest process's backward.
- `compute_seconds`: `seconds` less both waits, the process's own forward and backward in wall time. With more
  processes than cores it still includes time spent runnable but waiting for a core.
- `thread_seconds`: `time.thread_time()` over the same call: CPU time of the calling thread only. Every kernel runs in
  that thread (`torch.set_num_threads(1)`), a blocked collective uses none, and a process waiting for a core is not
  charged, so this is the process's own work even with 4 processes on 2 cores.
- `pairs`, `row_tokens` (the packed row's `host_row.seq_lens` summed) and `row_cost` (its estimated FLOPs,
  `packing.balance.row_cost`, the quantity `padfree/balance_cost_max_over_mean` is made of).

Per optimizer step: `wall_seconds` from `on_step_begin` to `on_step_end` (its micro-batches, the all-reduce, clipping
and the optimizer), and `interval_seconds` from the previous step's end (adds fetching and collating the step's
batches and logging). The first `--warmup` steps are left out of the report.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from trl_padfree import DPOConfig, DPOTrainer
from trl_padfree.cli import exit_without_finalizing
from trl_padfree.costs.flops import DecoderShape
from trl_padfree.data import load_demo_dataset, load_demo_tokenizer
from trl_padfree.features.pair_weighted_steps import COST_RATIO_METRIC
from trl_padfree.packing.balance import row_cost
from trl_padfree.packing.layout import HOST_ROW

# TRL 1.16 still calls transformers 5's deprecated gradient checkpointing names
warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6", category=FutureWarning)

SETTINGS = ("random", "batch_rebalance")  # transformers' `train_sampling_strategy` values compared
# The collectives a training step reaches from Python: accelerate's gathers and reductions (TRL's metrics, the
# balanced loss's pair count), DDP's buffer broadcast before a forward. `all_gather_object` calls `all_gather` itself:
# only the outermost call is counted.
TIMED_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast",
                     "_broadcast_coalesced", "barrier", "gather", "reduce")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a saved model folder (with the shipped tokenizer)")
    parser.add_argument("--output", required=True, help="rank 0 writes the JSON report here")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--grad-accum", type=int, nargs="+", default=[1], help="one pair of runs for each")
    parser.add_argument("--batch-size", type=int, default=4, help="per_device_train_batch_size")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps run first and not reported")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return parser.parse_args(argv)


class CollectiveClock:
    """Wall seconds spent in `torch.distributed`'s collectives called from Python, while installed (a context)."""

    def __init__(self):
        self.seconds = 0.0
        self._depth = 0
        self._originals = {}

    def __enter__(self) -> CollectiveClock:
        for name in TIMED_COLLECTIVES:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._timed(self._originals[name]))
        return self

    def __exit__(self, *exc_info) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _timed(self, collective):
        @functools.wraps(collective)
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return collective(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start

        return timed


class StepClock(TrainerCallback):
    """Times every `training_step` call of `trainer` (see the module docstring) and every optimizer step."""

    def __init__(self, trainer, collectives: CollectiveClock):
        self.collectives = collectives
        self.shape = DecoderShape.of_model(trainer.accelerator.unwrap_model(trainer.model))
        self.steps: list[dict] = []
        self.last_gradient: float | None = None  # when this process's backward accumulated its latest gradient
        self.last_step_end: float | None = None
        for parameter in trainer.model.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._gradient_accumulated)
        self._training_step = trainer.training_step
        trainer.training_step = self.timed_training_step  # Trainer's loop calls `self.training_step`

    def _gradient_accumulated(self, parameter) -> None:
        self.last_gradient = time.perf_counter()

    def timed_training_step(self, model, inputs, num_items_in_batch=None):
        row = inputs[HOST_ROW]  # before the call: Trainer drops its reference to the batch
        collectives_before, self.last_gradient = self.collectives.seconds, None
        start, cpu_start = time.perf_counter(), time.thread_time()
        loss = self._training_step(model, inputs, num_items_in_batch)
        end, cpu_end = time.perf_counter(), time.thread_time()
        collective = self.collectives.seconds - collectives_before
        gradient_sync = end - self.last_gradient if self.last_gradient is not None else 0.0
        self.steps[-1]["micro_batches"].append(
            {
                "seconds": end - start,
                "thread_seconds": cpu_end - cpu_start,
                "collective_seconds": collective,
                "gradient_sync_seconds": gradient_sync,
                "compute_seconds": end - start - collective - gradient_sync,
                "pairs": len(row.seq_lens) // 2,
                "row_tokens": sum(row.seq_lens),
                "row_cost": row_cost(self.shape, row, reference_forward=True),
            }
        )
        return loss

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_step_end = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append({"step": state.global_step + 1, "begin": time.perf_counter(), "micro_batches": []})

    def on_step_end(self, args, state, control, **kwargs):
        end, step = time.perf_counter(), self.steps[-1]
        step["wall_seconds"] = end - step.pop("begin")
        step["interval_seconds"], self.last_step_end = end - self.last_step_end, end


def build_trainer(setting: str, grad_accum: int, options: argparse.Namespace) -> DPOTrainer:
    output = Path(options.output)
    args = DPOConfig(
        output_dir=str(output.parent / f"{output.stem}-{setting}-accum{grad_accum}"),
        padding_free=True,
        train_sampling_strategy=setting,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=grad_accum,
        max_steps=options.warmup + options.steps,
        max_length=options.max_length,
        logging_steps=1,  # one `padfree/balance_cost_max_over_mean` per step
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        # TRL's DPOConfig defaults to bf16: autocast on a CPU without native bf16 makes every matmul ~10x slower
        bf16=False,
        seed=0,
    )
    return DPOTrainer(
        model=options.model,
        args=args,
        train_dataset=load_demo_dataset("train"),
        processing_class=load_demo_tokenizer(),
    )


def gather_to_all(value) -> list:
    """`value` of every process, in rank order (one process: `[value]`)."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def measure(setting: str, grad_accum: int, options: argparse.Namespace, collectives: CollectiveClock) -> dict:
    """One training run: its measured steps, `processes[rank][step]`, and the logged cost ratio of each step."""
    trainer = build_trainer(setting, grad_accum, options)
    clock = StepClock(trainer, collectives)
    trainer.add_callback(clock)
    trainer.train()
    logged = {
        entry["step"]: entry[COST_RATIO_METRIC] for entry in trainer.state.log_history if COST_RATIO_METRIC in entry
    }
    measured = clock.steps[options.warmup :]
    return {
        "setting": setting,
        "grad_accum": grad_accum,
        "processes": gather_to_all(measured),
        "logged_cost_max_over_mean": [logged.get(step["step"]) for step in measured],
    }


def main(argv=None) -> None:
    options = parse_args(argv)
    # One thread per process: 4 processes on 2 cores contend for cores, not also for each other's thread pools,
    # and every kernel runs in the thread `time.thread_time` measures
    torch.set_num_threads(options.threads)
    with CollectiveClock() as collectives:
        runs = [
            measure(setting, grad_accum, options, collectives)
            for grad_accum in options.grad_accum
            for setting in options.settings
        ]
    if not dist.is_initialized() or dist.get_rank() == 0:
        report = {
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "threads_per_process": options.threads,
            "batch_size": options.batch_size,
            "max_length": options.max_length,
            "warmup_steps": options.warmup,
            "runs": runs,
        }
        Path(options.output).write_text(json.dumps(report, indent=1))
    # torch's gloo workers may still be releasing the last collectives (trl_padfree.cli.exit_without_finalizing)
    if dist.is_initialized():
        exit_without_finalizing()


if __name__ == "__main__":
    main()
