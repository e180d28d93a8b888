"""One command for a lent GPU (one H100 or H200, no network, under 8 minutes): the GPU tests, the bench in users'
precisions, one profiled step per mode, and a report that carries the machine, versions and command.

    python tools/gpu_report.py --out DIR            # on the GPU
    python tools/gpu_report.py --out DIR --dry-run  # on CPU: the same code on tiny shapes, 1 step (CI)

Stages, each recorded as passed, failed (the error's line; its traceback in DIR/errors.log) or skipped; a failed stage
does not stop the next, and the report is rewritten after every stage:

    pytest    python -m pytest -m gpu -q -p no:cacheprovider, its log in DIR/pytest.log (a dry run records the
              command only: it is not run from inside a test run)
    build     per model shape and precision (TRL's default: float32 weights under bf16 autocast; bf16 weights), the
              trainers of three modes: padded TRL, padfree_varlen, padfree_varlen+prefix_sharing=auto
    bench     their steps on the same batches (`trl-padfree bench`'s rows: warm-ups, then alternating measured steps,
              CUDA events), with varlen kernel calls per attention call
    profile   one step per mode under torch.profiler: the top 10 CUDA kernels by time, and the share of the step the
              GPU is idle (host gaps); on CPU, the top 10 operators by CPU time

Writes DIR/gpu_report.json (every stage, row and profile, and the bench's full rows) and DIR/gpu_report.md.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from trl_padfree.cli import build_parser
from trl_padfree.cli.bench.harness import bench_device, device_name, make_batches, markdown_table
from trl_padfree.cli.bench.precision import bench_precisions
from trl_padfree.cli.bench.rows import BenchRow, bench_trainers, build_trainers, release_memory, set_step_counts
from trl_padfree.data import load_demo_tokenizer

ROOT = Path(__file__).resolve().parent.parent
PYTEST_COMMAND = ("python", "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider")
PYTEST_TIMEOUT_S = 240
# A stage that would start later than this after the start is skipped, so the report fits the lent 8 minutes
TIME_BUDGET_S = 400
TOP_KERNELS = 10
PACKAGES = ("torch", "transformers", "trl", "accelerate", "peft", "trl-padfree")


@dataclass(frozen=True)
class BenchPlan:
    """One model shape's bench: both precisions, padded TRL against padfree_varlen and prefix sharing auto."""

    model: str
    lora: bool
    pairs_per_batch: int
    max_length: int
    warmup: int
    steps: int
    distribution: str = "ultrafeedback"

    @property
    def label(self) -> str:
        return self.model + (" (LoRA)" if self.lora else "")

    def bench_args(self, device: str) -> list[str]:
        """`trl-padfree bench`'s arguments for the same rows."""
        args = ["--model", self.model, "--precision", "both", "--backends", "padfree_varlen"]
        args += ["--prefix-sharing", "auto", "--distributions", self.distribution, "--device", device]
        args += ["--warmup", str(self.warmup), "--steps", str(self.steps)]
        args += ["--pairs-per-batch", str(self.pairs_per_batch), "--max-length", str(self.max_length)]
        return args + (["--lora"] if self.lora else [])


# Sized for the 8 minutes: a 0.5B step takes tenths of a second; the 8B with LoRA a second or two, its trainers
# sharing one copy of the weights (32 GB in float32), 4 pairs of at most 512 tokens so padded TRL fits an H100
GPU_PLANS = (
    BenchPlan("qwen2.5-0.5b", lora=False, pairs_per_batch=8, max_length=1024, warmup=2, steps=5),
    BenchPlan("llama3.1-8b", lora=True, pairs_per_batch=4, max_length=512, warmup=2, steps=4),
)
DRY_RUN_PLANS = (
    BenchPlan("tiny", lora=False, pairs_per_batch=2, max_length=32, warmup=0, steps=1),
    BenchPlan("tiny", lora=True, pairs_per_batch=2, max_length=32, warmup=0, steps=1),
)


@dataclass
class Stage:
    name: str
    status: str  # passed, failed or skipped
    seconds: float
    detail: str = ""  # the pytest summary, an error's line, or why a stage was skipped


@dataclass
class Report:
    """What the report holds, written to `out` after every stage."""

    out: Path
    command: str
    dry_run: bool
    device: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    stages: list[Stage] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)  # per model, precision and mode
    profiles: list[dict] = field(default_factory=list)
    bench_commands: list[str] = field(default_factory=list)
    bench_rows: list[dict] = field(default_factory=list)  # the bench's own rows, every field

    def run_stage(self, name: str, work: Callable[[], object]):
        """`work()`'s result, or None when it failed or the time budget is spent; either way recorded. A string
        result is the stage's detail line."""
        if time.monotonic() - self.started > TIME_BUDGET_S:
            self.record(Stage(name, "skipped", 0.0, f"would start after the {TIME_BUDGET_S} s budget"))
            return None
        start = time.monotonic()
        try:
            result = work()
        except Exception as error:  # recorded, and the next stage runs
            with (self.out / "errors.log").open("a") as log:
                log.write(f"== {name}\n{traceback.format_exc()}\n")
            message = " ".join(f"{type(error).__name__}: {error}".split())
            self.record(Stage(name, "failed", time.monotonic() - start, message[:300]))
            return None
        self.record(Stage(name, "passed", time.monotonic() - start, result if isinstance(result, str) else ""))
        return result

    def record(self, stage: Stage) -> None:
        self.stages.append(stage)
        self.write()

    def write(self) -> None:
        data = {key: value for key, value in asdict(self).items() if key not in ("out", "started")}
        data["wall_s"] = time.monotonic() - self.started
        (self.out / "gpu_report.json").write_text(json.dumps(data, indent=2) + "\n")
        (self.out / "gpu_report.md").write_text(format_markdown(self, data["wall_s"]))


# ---------------------------------------------------------------------------------------------------------------------
# Stages


def run_gpu_tests(out: Path) -> str:
    """The GPU tests in a process of their own, the log in `out`; their summary line, or an error with it."""
    log_path = out / "pytest.log"
    environment = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, *PYTEST_COMMAND[1:]]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=PYTEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: pytest and any process it started
            process.wait()
            raise TimeoutError(f"the GPU tests ran past {PYTEST_TIMEOUT_S} s (log: pytest.log)") from None
    lines = log_path.read_text().strip().splitlines()
    summary = lines[-1].strip("= ") if lines else "no output"
    if returncode:  # 5 included: no GPU test collected
        raise RuntimeError(f"exit status {returncode}: {summary}")
    return summary


def open_device(report: Report, dry_run: bool) -> torch.device:
    """The device the benches run on, its name in the report: set up as `trl-padfree bench` does (a waiting host
    thread sleeps, asked before any CUDA context exists)."""
    device, _ = bench_device("cpu" if dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run with --dry-run on a machine without a GPU")
    report.device = device_name(device)
    return device


def bench_plan(report: Report, plan: BenchPlan, device: torch.device) -> None:
    """Build, bench and profile one plan, precision by precision, each precision's trainers released after."""
    options = build_parser("bench").parse_args(["bench", *plan.bench_args(device.type)])
    set_step_counts(options)
    report.bench_commands.append(shlex.join(["trl-padfree", "bench", *plan.bench_args(device.type)]))
    for precision in bench_precisions(options.precision, device):
        name = f"{plan.label} {precision.name}"
        trainers = report.run_stage(f"build {name}", functools.partial(build_trainers, options, precision, device))
        if trainers is None:
            continue
        bench = functools.partial(bench_trainers, trainers, options, device, precision)
        rows = report.run_stage(f"bench {name}", bench)
        if rows:
            report.rows += step_rows(plan, rows)
            report.bench_rows += [asdict(row) for row in rows]
        profiles = report.run_stage(f"profile {name}", functools.partial(profile_modes, trainers, options, device))
        for mode, summary in (profiles or {}).items():
            report.profiles.append(dict(model=plan.label, precision=precision.name, mode=mode, **summary))
        del trainers
        release_memory(device)


def step_rows(plan: BenchPlan, rows: list[BenchRow]) -> list[dict]:
    """One row per mode, padded TRL's first (its speedup 1; it never calls the varlen kernel: none counted)."""
    first = rows[0]
    padded = dict(
        model=plan.label,
        precision=first.precision,
        mode="padded",
        step_s=first.padded_step_s,
        real_tokens_per_s=first.real_tokens / sum(first.padded_step_times_s),
        speedup=1.0,
        varlen_calls_per_attention_call=None,
        peak_mem_mb=first.padded_peak_mem_mb,
    )
    return [padded] + [
        dict(
            model=plan.label,
            precision=row.precision,
            mode=row.backend,
            step_s=row.padfree_step_s,
            real_tokens_per_s=row.real_tokens_per_s,
            speedup=row.speedup,
            varlen_calls_per_attention_call=row.varlen_calls_per_attention_call,
            peak_mem_mb=row.padfree_peak_mem_mb,
        )
        for row in rows
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Profiles


def profile_modes(trainers: dict, options: argparse.Namespace, device: torch.device) -> dict[str, dict]:
    """One profiled step per mode, on the same batch (the first of the bench's batches)."""
    vocab_size = len(load_demo_tokenizer())
    batch = make_batches(
        options.distributions[0], 1, options.pairs_per_batch, options.max_length, vocab_size, options.seed
    )[0]
    return {mode or "padded": profile_step(trainer, batch, device) for mode, trainer in trainers.items()}


def profile_step(trainer, batch: list[dict], device: torch.device) -> dict:
    """One `training_step` under torch.profiler, collated outside it, the GPU's queue drained inside it."""
    inputs = trainer.data_collator(batch)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as profiler:
        trainer.training_step(trainer.model, inputs)
        if cuda:
            torch.cuda.synchronize(device)
    trainer.model.zero_grad(set_to_none=True)
    return summarize_events(profiler.events())


# Ranges a `record_function` puts on the GPU's timeline: they span kernels, they are not work of their own
ANNOTATIONS = ("gpu_user_annotation", "user_annotation")


def summarize_events(events: Iterable) -> dict:
    """Host gaps and the top kernels of one profiled step, from its events (microseconds): the step spans its first
    event's start to its last event's end; the GPU is busy where a kernel (or copy) runs on any stream, idle for the
    rest of the span. Host time: the CPU time of operators and CUDA runtime calls (each event's own, so nested calls
    count once). Without device events (CPU), the top operators by their own CPU time."""
    events = [event for event in events if getattr(event, "activity_type", None) not in ANNOTATIONS]
    kernels = [event for event in events if event.device_type == DeviceType.CUDA]
    host = [event for event in events if event.device_type == DeviceType.CPU]
    span_us = max(event.time_range.end for event in events) - min(event.time_range.start for event in events)
    busy_us = covered_length((kernel.time_range.start, kernel.time_range.end) for kernel in kernels)
    if kernels:
        top = top_by_time((kernel.name, kernel.time_range.end - kernel.time_range.start) for kernel in kernels)
    else:
        top = top_by_time((event.name, event.self_cpu_time_total) for event in host)
    return dict(
        span_ms=span_us / 1e3,
        gpu_busy_ms=busy_us / 1e3 if kernels else None,
        gpu_idle_share=1 - busy_us / span_us if kernels and span_us else None,
        host_ms=sum(event.self_cpu_time_total for event in host) / 1e3,
        kernel_ms=sum(kernel.time_range.end - kernel.time_range.start for kernel in kernels) / 1e3,
        top_of="CUDA kernels" if kernels else "CPU operators (no CUDA kernel ran)",
        top=top,
    )


def covered_length(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of `intervals`: overlapping kernels (several streams) count once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def top_by_time(timings: Iterable[tuple[str, float]]) -> list[dict]:
    """The `TOP_KERNELS` names with the most total time (microseconds in), with their call counts."""
    total_us, calls = defaultdict(float), defaultdict(int)
    for name, microseconds in timings:
        total_us[name] += microseconds
        calls[name] += 1
    ranked = sorted(total_us, key=total_us.get, reverse=True)[:TOP_KERNELS]
    return [dict(name=name, ms=total_us[name] / 1e3, calls=calls[name]) for name in ranked]


# ---------------------------------------------------------------------------------------------------------------------
# The report


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "cuda": torch.version.cuda or "none"}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    found["commit"] = git_commit()
    return found


def git_commit() -> str:
    """The checkout's commit, `+changes` when the working tree differs from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if commit.returncode:
        return "unknown"
    return commit.stdout.strip() + ("+changes" if status.stdout.strip() else "")


STEP_COLUMNS = ("model", "precision", "mode", "s/step", "real tokens/s", "speedup over padded")
STEP_COLUMNS += ("varlen calls / attention call", "peak MB")


def format_markdown(report: Report, wall_s: float) -> str:
    lines = [
        "# GPU report" + (" (dry run on CPU)" if report.dry_run else ""),
        "",
        f"- device: {report.device}",
        "- versions: " + ", ".join(f"{name} {version}" for name, version in report.versions.items()),
        f"- command: `{report.command}` ({wall_s:.0f} s)",
        *(f"- bench: `{command}`" for command in report.bench_commands),
        "",
        "## Stages",
        "",
        markdown_table(
            ("stage", "status", "s", "detail"),
            ([stage.name, stage.status, f"{stage.seconds:.1f}", stage.detail] for stage in report.stages),
        ),
        "",
        "## Steps",
        "",
        markdown_table(STEP_COLUMNS, (step_cells(row) for row in report.rows)),
        "",
        "## One profiled step per mode",
    ]
    for summary in report.profiles:
        lines += ["", *profile_lines(summary)]
    return "\n".join(lines) + "\n"


def step_cells(row: dict) -> list[str]:
    calls = row["varlen_calls_per_attention_call"]
    peak = row["peak_mem_mb"]
    return [
        row["model"],
        row["precision"],
        row["mode"],
        f"{row['step_s']:.3f}",
        f"{row['real_tokens_per_s']:,.0f}",
        f"{row['speedup']:.2f}x",
        "-" if calls is None else f"{calls:.2f}",
        "n/a" if peak is None else f"{peak:,.0f}",
    ]


def profile_lines(summary: dict) -> list[str]:
    title = f"### {summary['model']}, {summary['precision']}, {summary['mode']}"
    if summary["gpu_idle_share"] is None:
        gaps = f"step {summary['span_ms']:.1f} ms, host {summary['host_ms']:.1f} ms, no CUDA kernel"
    else:
        gaps = (
            f"step {summary['span_ms']:.1f} ms; GPU busy {summary['gpu_busy_ms']:.1f} ms, idle "
            f"{summary['gpu_idle_share']:.0%} of the step; host (operators, CUDA runtime) {summary['host_ms']:.1f} ms, "
            f"kernels {summary['kernel_ms']:.1f} ms"
        )
    cells = ([entry["name"][:80], f"{entry['ms']:.2f}", str(entry["calls"])] for entry in summary["top"])
    return [title, "", gaps, "", markdown_table((f"top {summary['top_of']}", "ms", "calls"), cells)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run every stage, write the report; 0 when no stage failed."""
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out", required=True, help="folder for gpu_report.json, gpu_report.md and the logs")
    parser.add_argument("--dry-run", action="store_true", help="on CPU, tiny shapes, 1 step; pytest not run (CI)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "tools/gpu_report.py", *(sys.argv[1:] if argv is None else argv)])
    report = Report(out, command, args.dry_run, versions=versions())
    if args.dry_run:
        report.record(Stage("pytest", "skipped", 0.0, f"dry run; on a GPU: {shlex.join(PYTEST_COMMAND)}"))
    else:
        report.run_stage("pytest", functools.partial(run_gpu_tests, out))
    device = report.run_stage("device", functools.partial(open_device, report, args.dry_run))
    for plan in (DRY_RUN_PLANS if args.dry_run else GPU_PLANS) if device is not None else ():
        bench_plan(report, plan, device)
    report.write()
    print(f"wrote {out / 'gpu_report.md'} and {out / 'gpu_report.json'}")
    return int(any(stage.status == "failed" for stage in report.stages))


if __name__ == "__main__":
    sys.exit(main())
