"""Time one context-parallel layout's training on CPU processes: static (every row over all `--cp-size` ranks), dynamic
(`dynamic_context_parallel=True`: each row over 1, 2 ... `--cp-size` ranks) or plain data parallelism (`--cp-size 1`).

One process of a DDP launch (tools/measure/measure_dynamic_context_parallel.py runs it under `accelerate launch`
over gloo, once per layout). It trains `trl_padfree.DPOTrainer` padding-free for one epoch over the pairs of
`--dataset` (a JSON list of prompt/chosen/rejected texts), at `--rank-tokens` tokens a rank
(`max_tokens_per_batch = --rank-tokens x --cp-size`). Rank 0 writes every process's numbers as JSON. With
`--calibrate` it instead measures what the cost model's `Link` needs, on these processes (`calibrate`).

Per process and optimizer step:
- `wall_seconds`: `on_step_begin` to `on_step_end` (its micro-batches, gradient all-reduce, optimizer);
  `thread_seconds`: `time.thread_time()` of the training thread over the same span (every kernel runs in it,
  `torch.set_num_threads(1)`; a process waiting for a core or blocked in a collective is not charged).
- per micro-batch: `training_step`'s wall and thread seconds, and the row this process ran: its ranks, its tokens
  (padding included), its attention segments (`[length, prefix]`) and scored tokens, from the collated host row:
  what the cost model prices.
- `gathered`: bytes this process received in the split row's collectives, counted as they ran (wrapping
  `RowGroup.gather` and the reduce-scatter of its backward): keys and values (4-D tensors), and the other gathers (the
  row's per-token outputs).
Per process: `ru_maxrss` (peak resident memory of the process, `resource.getrusage`) after building the trainer and
after training.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import TrainerCallback

from trl_padfree import DPOConfig, DPOTrainer
from trl_padfree.cli import exit_without_finalizing
from trl_padfree.costs.flops import DecoderShape
from trl_padfree.data import load_demo_tokenizer
from trl_padfree.features.pair_weighted_steps import RANK_SHARE_METRICS
from trl_padfree.packing.layout import HOST_ROW
from trl_padfree.packing.rank_shares import ROW_RANKS
from trl_padfree.parallel import groups

# TRL 1.16 still calls transformers 5's deprecated gradient checkpointing names
warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6", category=FutureWarning)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a saved model folder (with the shipped tokenizer)")
    parser.add_argument("--output", required=True, help="rank 0 writes the JSON report here")
    parser.add_argument("--dataset", help="a JSON list of {prompt, chosen, rejected}")
    parser.add_argument("--cp-size", type=int, default=4, help="context_parallel_size (1: data parallelism)")
    parser.add_argument("--dynamic", action="store_true", help="dynamic_context_parallel=True")
    parser.add_argument("--rank-tokens", type=int, default=1024, help="tokens a rank holds at most")
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--calibrate", action="store_true", help="measure the link instead of training")
    return parser.parse_args(argv)


class GatherCounter:
    """Bytes this process receives in a split row's collectives while installed (a context): `RowGroup.gather`'s
    all-gather (forward) and the reduce-scatter of its backward."""

    def __init__(self):
        self.bytes = {"keys_values": 0, "other": 0}

    def __enter__(self) -> GatherCounter:
        self._gather, self._reduce_scatter = groups.RowGroup.gather, groups._reduce_scatter_from
        counter = self

        def gather(row_group, tensor, dim=1):
            counter.add(tensor.ndim, tensor.numel() * tensor.element_size() * (row_group.size - 1))
            return counter._gather(row_group, tensor, dim)

        def reduce_scatter(output, tensor, group):
            # Receives every other rank's share of its own chunk: as many bytes as the forward's gather
            counter.add(tensor.ndim, output.numel() * output.element_size() * (dist.get_world_size(group) - 1))
            return counter._reduce_scatter(output, tensor, group)

        groups.RowGroup.gather, groups._reduce_scatter_from = gather, reduce_scatter
        return self

    def __exit__(self, *exc_info) -> None:
        groups.RowGroup.gather, groups._reduce_scatter_from = self._gather, self._reduce_scatter

    def add(self, ndim: int, received: int) -> None:
        # keys and values travel as one (1, chunk, kv_heads, k + v dims) tensor (parallel/context.py)
        self.bytes["keys_values" if ndim == 4 else "other"] += received


class StepClock(TrainerCallback):
    """Times every optimizer step and `training_step` call of `trainer`, and records each micro-batch's row."""

    def __init__(self, trainer, gathers: GatherCounter, static_ranks: int):
        self.gathers, self.static_ranks = gathers, static_ranks
        self.steps: list[dict] = []
        self._training_step = trainer.training_step
        trainer.training_step = self.timed_training_step  # Trainer's loop calls `self.training_step`

    def timed_training_step(self, model, inputs, num_items_in_batch=None):
        row, ranks = inputs[HOST_ROW], inputs.get(ROW_RANKS, self.static_ranks)
        start, thread_start = time.perf_counter(), time.thread_time()
        loss = self._training_step(model, inputs, num_items_in_batch)
        self.steps[-1]["micro_batches"].append(
            {
                "seconds": time.perf_counter() - start,
                "thread_seconds": time.thread_time() - thread_start,
                "ranks": ranks,
                "row_tokens": row.cu_seq_lens[-1],
                "real_tokens": sum(row.seq_lens),
                "pairs": len(row.seq_lens) // 2,
                "segments": [[row.seq_lens[s] - row.prefix_lens[s], row.prefix_lens[s]] for s in row.laid_out],
                "scored_tokens": row.scored_tokens,
            }
        )
        return loss

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append(
            {
                "step": state.global_step + 1,
                "begin": time.perf_counter(),
                "thread_begin": time.thread_time(),
                "gathered_before": dict(self.gathers.bytes),
                "micro_batches": [],
            }
        )

    def on_step_end(self, args, state, control, **kwargs):
        step = self.steps[-1]
        step["wall_seconds"] = time.perf_counter() - step.pop("begin")
        step["thread_seconds"] = time.thread_time() - step.pop("thread_begin")
        before = step.pop("gathered_before")
        step["gathered"] = {key: value - before[key] for key, value in self.gathers.bytes.items()}


def gather_to_all(value) -> list:
    """`value` of every process, in rank order."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def train(options: argparse.Namespace) -> dict:
    output = Path(options.output)
    extra = {}
    if options.cp_size > 1:
        extra["context_parallel_size"] = options.cp_size
    if options.dynamic:
        extra["dynamic_context_parallel"] = True
    args = DPOConfig(
        output_dir=str(output.parent / f"{output.stem}-trainer"),
        padding_free=True,
        max_tokens_per_batch=options.rank_tokens * options.cp_size,
        num_train_epochs=1,
        max_length=options.max_length,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        # TRL's DPOConfig defaults to bf16: autocast on a CPU without native bf16 makes every matmul ~10x slower
        bf16=False,
        seed=0,
        **extra,
    )
    dataset = Dataset.from_list(json.loads(Path(options.dataset).read_text()))
    trainer = DPOTrainer(model=options.model, args=args, train_dataset=dataset, processing_class=load_demo_tokenizer())
    rss_built = peak_rss_bytes()
    with GatherCounter() as gathers:
        clock = StepClock(trainer, gathers, static_ranks=options.cp_size)
        trainer.add_callback(clock)
        trainer.train()
    logged = [
        {name: entry[name] for name in RANK_SHARE_METRICS if name in entry}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    shape = asdict(DecoderShape.of_model(trainer.accelerator.unwrap_model(trainer.model)))
    return {
        "shape": shape,
        "logged_rank_shares": logged,
        "processes": gather_to_all(
            {"steps": clock.steps, "peak_rss_bytes_built": rss_built, "peak_rss_bytes": peak_rss_bytes()}
        ),
    }


# ---------------------------------------------------------------------------------------------------------------------
# The link: what one process computes per second, and what an all-gather costs, on these processes

CALIBRATION_TOKENS = 1024
GATHER_CHUNK_BYTES = (4_096, 65_536, 262_144, 1_048_576)  # each rank's share of one all-gather
GATHER_REPEATS = 20


def calibrate(options: argparse.Namespace) -> dict:
    """On every process at once, as training runs them: the FLOP rate of the model's matmuls (a chunk of
    `CALIBRATION_TOKENS` tokens through each layer's projections and MLP and the LM head, forward and backward
    shapes), in wall time and in the thread's own CPU time; and per group size (2, 4) the wall time of all-gathers of
    `GATHER_CHUNK_BYTES` a rank, the median of `GATHER_REPEATS`."""
    config = json.loads((Path(options.model) / "config.json").read_text())
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    weights = [
        torch.randn(hidden, heads * head_dim),
        torch.randn(hidden, 2 * kv_heads * head_dim),
        torch.randn(heads * head_dim, hidden),
        torch.randn(hidden, 2 * intermediate),
        torch.randn(intermediate, hidden),
        torch.randn(hidden, config["vocab_size"]),
    ]
    tokens = torch.randn(CALIBRATION_TOKENS, max(hidden, intermediate, heads * head_dim))
    flops_once = sum(2 * CALIBRATION_TOKENS * w.shape[0] * w.shape[1] for w in weights)

    def matmuls():
        for weight in weights:
            inputs = tokens[:, : weight.shape[0]]
            out = inputs @ weight  # forward
            _ = out @ weight.T  # backward: the input's gradient
            _ = inputs.T @ out  # and the weight's

    matmuls()
    dist.barrier()
    repeats = 0
    start, thread_start = time.perf_counter(), time.thread_time()
    while time.perf_counter() - start < 3.0:
        matmuls()
        repeats += 1
    wall, thread = time.perf_counter() - start, time.thread_time() - thread_start
    flops = 3 * flops_once * repeats
    gathers = {}
    world = dist.get_world_size()
    for size in (2, 4):
        if size > world:
            continue
        group = groups.context_parallel_blocks(world)[size] if size < world else None
        process_group = group.group if group is not None else None
        for chunk_bytes in GATHER_CHUNK_BYTES:
            chunk = torch.ones(chunk_bytes // 4)
            out = chunk.new_empty(chunk.numel() * size)
            times = []
            for _ in range(GATHER_REPEATS + 2):
                dist.barrier()
                begin = time.perf_counter()
                groups.all_gather_in_place()(out, chunk, group=process_group)
                times.append(time.perf_counter() - begin)
            gathers.setdefault(str(size), []).append(
                {"received_bytes": chunk_bytes * (size - 1), "seconds": statistics.median(times[2:])}
            )
    return {"matmul_flops": flops, "matmul_wall_seconds": wall, "matmul_thread_seconds": thread, "gathers": gathers}


def main(argv=None) -> None:
    options = parse_args(argv)
    # One thread per process: 4 processes on 2 cores contend for cores, not also for each other's thread pools
    torch.set_num_threads(options.threads)
    if options.calibrate:
        from accelerate import PartialState

        PartialState()  # the process group, as accelerate launches it
        report = {"processes": gather_to_all(calibrate(options))}
    else:
        report = train(options)
    report |= {"world_size": dist.get_world_size(), "threads_per_process": options.threads}
    if dist.get_rank() == 0:
        Path(options.output).write_text(json.dumps(report))
    # torch's gloo workers may still be releasing the last collectives (trl_padfree.cli.exit_without_finalizing)
    exit_without_finalizing()


if __name__ == "__main__":
    main()
