"""Measure what `train_sampling_strategy="batch_rebalance"` does to data-parallel processes' step times on CPU.

Run from the repository root, on a quiet machine (other work on the cores shows up as imbalance):

    python3 tools/measure/measure_balanced_ranks.py --processes 2 4 --output docs/bench/balanced_ranks_cpu.json

For each process count, one `accelerate launch` (trl_padfree/cli/accelerate_configs/multi_gpu.yaml: DDP over gloo on CPU
processes, as tests/support/distributed_runs.py launches it) runs tests/support/distributed/time_ranks.py, which trains
`trl_padfree.DPOTrainer` with `padding_free=True` on the shipped preference data, `max_length` 1024 (pairs of a few
hundred to a few thousand tokens), a Llama of `--hidden-size` x `--layers` built locally, once with the default
sampler (`random`) and once balanced, the same seed and steps; see its docstring for what is timed and how.

The table gives, for each launch and run, means over the measured steps of:
- compute max/mean: the slowest process's forward+backward over the mean process's, in wall time with the waits at
  collectives taken out (over micro-steps as `packing.balance.imbalance`: sum of each micro-step's max over sum of
  its mean; with one micro-step, max / mean). The step waits for the slowest process; 1.0 is perfect balance.
- thread max/mean: the same with `time.thread_time()`, each process's own CPU time. With 4 processes on 2 cores a
  process's wall time also holds the time it waited for a core, so this is the figure that says what each process
  costs; the wall-time figure of an oversubscribed machine does not.
- est. cost and logged cost: the estimated FLOP ratio of the rows trained (`row_cost`; the balanced run logs it as
  `padfree/balance_cost_max_over_mean`, which should match).
- tokens max/mean: the same ratio for each process's row tokens per step.
- wall s/step (`on_step_begin` to `on_step_end`, slowest process) and interval s/step (step end to step end, with the
  batches' collation and logging), and below the table the random run's over the balanced run's: the gain.

With more processes than cores, a process that waits frees its core for the others, so a balanced step gains less
wall time than its compute ratio suggests: the thread-time ratio is the one that carries over to one core (or GPU)
per process. The JSON (`--output`) holds every process's numbers for every step and micro-batch, the machine, the
package versions and this command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers

from distributed_runs import ACCELERATE_CONFIGS, ROOT, checkout_environment, free_port  # noqa: E402

from trl_padfree.cli.bench.report import run_provenance
from trl_padfree.data import load_demo_tokenizer  # noqa: E402
from trl_padfree.packing.balance import imbalance  # noqa: E402
from trl_padfree.tiny import make_model  # noqa: E402

WORKER = ROOT / "tests" / "support" / "distributed" / "time_ranks.py"
PACKAGES = ("torch", "transformers", "trl", "accelerate")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4], help="one launch for each count")
    parser.add_argument("--output", type=Path, required=True, help="the JSON report")
    parser.add_argument("--grad-accum", type=int, nargs="+", default=[1, 2], help="gradient accumulation steps")
    parser.add_argument("--batch-size", type=int, default=4, help="per_device_train_batch_size")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps run first and not reported")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps reported per run")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--show-steps", action="store_true", help="also print every step's per-process times")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one launch may take")
    return parser.parse_args(argv)


def model_shape(hidden_size: int, layers: int) -> dict:
    """A Llama shape: heads of 64 dimensions, GQA with half as many key/value heads, SwiGLU at ~8/3 x hidden."""
    heads = max(1, hidden_size // 64)
    return dict(
        hidden_size=hidden_size,
        intermediate_size=round(hidden_size * 8 / 3 / 16) * 16,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
    )


def save_model(directory: Path, shape: dict) -> Path:
    """The Llama of `shape` over the shipped tokenizer, saved so every process (and TRL's reference) loads it by path."""
    make_model("llama", **shape).save_pretrained(directory)
    load_demo_tokenizer().save_pretrained(directory)
    return directory


def launch(processes: int, model: Path, output: Path, options: argparse.Namespace) -> dict:
    """tests/support/distributed/time_ranks.py under `accelerate launch`, DDP over gloo on `processes` CPU processes."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / "multi_gpu.yaml"),
        "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port", str(free_port()),
        str(WORKER), "--model", str(model), "--output", str(output), "--batch-size", str(options.batch_size),
        "--warmup", str(options.warmup), "--steps", str(options.steps),
        "--grad-accum", *map(str, options.grad_accum),
    ]  # fmt: skip
    # Not `accelerate launch --cpu`: it runs the script in one process, whatever --num_processes says
    environment = checkout_environment(ACCELERATE_USE_CPU="true", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(
        command, capture_output=True, text=True, env=environment, cwd=ROOT, timeout=options.timeout
    )
    if result.returncode != 0:
        sys.exit(f"launch of {processes} processes failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return json.loads(output.read_text())


# ---------------------------------------------------------------------------------------------------------------------
# Summaries


def micro_step_table(step_of_each_process: list[dict], key: str) -> list[list[float]]:
    """`table[micro_step][process]` of one optimizer step's micro-batch `key`."""
    rows = [[micro[key] for micro in step["micro_batches"]] for step in step_of_each_process]
    return [list(micro_step) for micro_step in zip(*rows, strict=True)]


def step_total(step: dict, key: str) -> float:
    return sum(micro[key] for micro in step["micro_batches"])


def summarize(run: dict) -> dict:
    """Means over the run's measured steps (see the module docstring)."""
    steps = list(zip(*run["processes"], strict=True))  # steps[step][process]
    compute_totals = [[step_total(process, "compute_seconds") for process in step] for step in steps]
    tokens = [[step_total(process, "row_tokens") for process in step] for step in steps]
    logged = [ratio for ratio in run["logged_cost_max_over_mean"] if ratio is not None]
    return {
        "processes": len(run["processes"]),
        "grad_accum": run["grad_accum"],
        "setting": run["setting"],
        "steps": len(steps),
        "compute_slowest_seconds": statistics.mean(max(totals) for totals in compute_totals),
        "compute_mean_seconds": statistics.mean(statistics.mean(totals) for totals in compute_totals),
        "compute_max_over_mean": statistics.mean(imbalance(micro_step_table(s, "compute_seconds")) for s in steps),
        "thread_max_over_mean": statistics.mean(imbalance(micro_step_table(s, "thread_seconds")) for s in steps),
        "estimated_cost_max_over_mean": statistics.mean(imbalance(micro_step_table(s, "row_cost")) for s in steps),
        "logged_cost_max_over_mean": statistics.mean(logged) if logged else None,
        "tokens_max_over_mean": statistics.mean(max(row) / statistics.mean(row) for row in tokens),
        "wall_seconds": statistics.mean(max(process["wall_seconds"] for process in step) for step in steps),
        "interval_seconds": statistics.mean(max(process["interval_seconds"] for process in step) for step in steps),
    }


def gains(summaries: list[dict]) -> list[str]:
    """Random over balanced wall time and interval, for each launch and accumulation that ran both."""
    by_key = {(row["processes"], row["grad_accum"], row["setting"]): row for row in summaries}
    lines = []
    for (processes, grad_accum, setting), balanced in by_key.items():
        random = by_key.get((processes, grad_accum, "random"))
        if setting == "batch_rebalance" and random is not None:
            lines.append(
                f"{processes} processes, accumulation {grad_accum}: balanced steps "
                f"{random['wall_seconds'] / balanced['wall_seconds']:.2f}x as fast by wall time per step, "
                f"{random['interval_seconds'] / balanced['interval_seconds']:.2f}x by interval"
            )
    return lines


def markdown_table(summaries: list[dict]) -> str:
    header = ("| processes | accum | setting | steps | compute s/step slowest / mean | compute max/mean "
              "| thread max/mean | est. cost max/mean | logged cost | tokens max/mean | wall s/step | interval s/step |")  # fmt: skip
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for row in summaries:
        logged = "" if row["logged_cost_max_over_mean"] is None else f"{row['logged_cost_max_over_mean']:.3f}"
        lines.append(
            f"| {row['processes']} | {row['grad_accum']} | {row['setting']} | {row['steps']} "
            f"| {row['compute_slowest_seconds']:.2f} / {row['compute_mean_seconds']:.2f} "
            f"| {row['compute_max_over_mean']:.3f} | {row['thread_max_over_mean']:.3f} "
            f"| {row['estimated_cost_max_over_mean']:.3f} | {logged} | {row['tokens_max_over_mean']:.3f} "
            f"| {row['wall_seconds']:.2f} | {row['interval_seconds']:.2f} |"
        )
    return "\n".join(lines)


def step_lines(run: dict) -> list[str]:
    """Each measured step: every process's compute and thread seconds, and the step's wall time."""
    lines = [f"{len(run['processes'])} processes, accumulation {run['grad_accum']}, {run['setting']}:"]
    for step in zip(*run["processes"], strict=True):
        compute = " ".join(f"{step_total(process, 'compute_seconds'):5.2f}" for process in step)
        thread = " ".join(f"{step_total(process, 'thread_seconds'):5.2f}" for process in step)
        wall = max(process["wall_seconds"] for process in step)
        lines.append(f"  step {step[0]['step']:3d}  compute [{compute}]  thread [{thread}]  wall {wall:5.2f}")
    return lines


# ---------------------------------------------------------------------------------------------------------------------
# The machine


def cpu_model() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")


def machine() -> dict:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "versions": {package: version(package) for package in PACKAGES},
    }


def main(argv=None) -> None:
    options = parse_args(argv)
    shape = model_shape(options.hidden_size, options.layers)
    report = {
        "provenance": run_provenance(vars(options)),
        "machine": machine(),
        "model": {"model_type": "llama", **shape},
        "launches": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        model = save_model(Path(scratch) / "model", shape)
        for processes in options.processes:
            print(f"{processes} processes ...", flush=True)
            start, load = time.perf_counter(), os.getloadavg()[0]
            launched = launch(processes, model, Path(scratch) / f"ranks-{processes}.json", options)
            report["launches"][str(processes)] = launched | {"load_average_before": load}
            print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    runs = [run for launched in report["launches"].values() for run in launched["runs"]]
    report["summary"] = [summarize(run) for run in runs]
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(report, indent=1))
    print(f"\n{report['machine']['cpu']}, {report['machine']['cores']} cores; {report['model']}\n")
    print(markdown_table(report["summary"]))
    print("\n" + "\n".join(gains(report["summary"])))
    if options.show_steps:
        print("\n" + "\n".join(line for run in runs for line in step_lines(run)))


if __name__ == "__main__":
    main()
