"""One command for a lent GPU (one H100 or H200, no network, under 8 minutes): the bench in users' settings, one
profiled step per mode, the GPU tests, and a report that carries the machine, versions and command.

    python tools/gpu_report.py --out DIR            # on the GPU, from the checkout's root (installed or not)
    python tools/gpu_report.py --out DIR --dry-run  # on CPU: the same code on tiny shapes, 1 step (CI)

Stages, in this order, each recorded as running when it starts, then passed, failed (the error's line; its traceback
in DIR/errors.log) or skipped; a failed stage does not stop the next:

    device    the GPU: name, driver, SM (compute capability), memory
    context parallel compute
              each rank's chunk of a context-parallel step, static against dynamic (rows on 1, 2 ... C ranks), on
              this one GPU, against the cost model's compute (tools/measure/gpu_context_parallel_compute.py; its own
              `CONTEXT_PARALLEL_SLICE_S`, before the benches); communication is modelled, not measured
    build     per bench plan and precision, one trainer per mode over one copy of the weights
    bench     their steps on the same batches (`trl-padfree bench`'s rows: one allocator reset, warm-ups of every
              mode, then alternating measured steps timed by CUDA events), with varlen kernel calls per attention call
    profile   one step per mode under torch.profiler: the top 10 CUDA kernels by time, and the share of the step the
              GPU is idle (host gaps); on CPU, the top 10 operators by CPU time
    pytest    python -m pytest -m gpu -q -p no:cacheprovider, its log in DIR/pytest.log (a dry run records the
              command only: it is not run from inside a test run)

The plans run headline shapes first (Qwen2.5-0.5B; Llama-3.1-8B with LoRA), then many pairs of one prompt
(Qwen2.5-0.5B on prompt groups: padded TRL, padfree_varlen, and prefix sharing computing each prompt and completion
once), then attention that torch's varlen kernel
cannot compute (GPT-OSS's sinks, Gemma 2's softcapping), each padded TRL on the kernel its users pick against packed
`padfree_varlen`. Every mode trains as TRL's `DPOConfig` does by default: activation checkpointing on.

The time budget: build, bench and profile stages stop at `TIME_BUDGET_S - PYTEST_SLICE_S` after the start, pytest at
`TIME_BUDGET_S`; a stage past its deadline is stopped where Python runs (a kernel or a synchronisation in progress
finishes first) and recorded failed, and a stage that would start past it is skipped.

DIR/gpu_report.json (every stage, row and profile, and the bench's full rows) and DIR/gpu_report.md are rewritten
whenever a stage starts or ends and whenever a row or a profile lands, so a run killed mid-stage leaves every row
measured before the kill, and the stage in progress reads "running".
"""

# The checkout goes on the path, and the hub offline, before anything imports transformers:
# ruff: noqa: E402
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python tools/gpu_report.py` from a checkout that is not installed
# The GPU machine has no network: the bench's models are built from configs, the tokenizer ships in the package, and
# nothing may wait on the hub (set before transformers and huggingface_hub read it at import; inherited by pytest)
os.environ["HF_HUB_OFFLINE"] = "1"

import argparse
import contextlib
import ctypes
import functools
import importlib.metadata
import json
import platform
import shlex
import signal
import statistics
import subprocess
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tools.measure import gpu_context_parallel_compute
from trl_padfree.cli import build_parser
from trl_padfree.cli.bench.harness import (
    HOST_BOUND_FRACTION,
    bench_device,
    cuda_sync_blocks,
    device_name,
    make_batches,
    markdown_table,
    padded_attention,
)
from trl_padfree.cli.bench.precision import BenchPrecision, bench_precisions
from trl_padfree.cli.bench.rows import BenchRow, bench_trainers, build_trainers, release_memory, set_step_counts
from trl_padfree.data import load_demo_tokenizer

PYTEST_COMMAND = ("python", "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider")
# The lent 8 minutes, less the wheels' install: the benches get all but the last `PYTEST_SLICE_S`, which is the GPU
# tests' (with whatever the benches leave)
TIME_BUDGET_S = 400
PYTEST_SLICE_S = 150
TOP_KERNELS = 10
CONTEXT_PARALLEL_SLICE_S = 90  # the context parallelism stage's at most (about 30 s on an H100), out of the benches'
PACKAGES = ("torch", "transformers", "trl", "accelerate", "peft", "flash-attn", "kernels", "trl-padfree")


@dataclass(frozen=True)
class BenchPlan:
    """One model shape's bench: padded TRL against padfree_varlen (and prefix sharing auto where asked), in each of
    `precision`'s precisions."""

    model: str
    lora: bool
    pairs_per_batch: int
    max_length: int
    warmup: int
    steps: int
    precision: str = "both"  # trl_default, then bf16
    prefix_sharing: str = "auto"  # or "none"
    distribution: str = "ultrafeedback"

    @property
    def label(self) -> str:
        grouped = " (prompt groups)" if self.distribution == "prompt_groups" else ""
        return self.model + (" (LoRA)" if self.lora else "") + grouped

    def bench_args(self, device: str) -> list[str]:
        """`trl-padfree bench`'s arguments for the same rows."""
        args = ["--model", self.model, "--precision", self.precision, "--backends", "padfree_varlen"]
        args += ["--prefix-sharing", self.prefix_sharing, "--distributions", self.distribution, "--device", device]
        args += ["--warmup", str(self.warmup), "--steps", str(self.steps)]
        args += ["--pairs-per-batch", str(self.pairs_per_batch), "--max-length", str(self.max_length)]
        return args + (["--lora"] if self.lora else [])


# Sized for the minutes, with checkpointing on: a 0.5B step takes tenths of a second; the 8B with LoRA a second or
# two, its trainers sharing one copy of the weights (32 GB in float32), 4 pairs of at most 512 tokens so padded TRL
# fits an H100; the 4-layer GPT-OSS and Gemma 2 stacks about a second, in TRL's default precision only, with a third
# warm-up step (a layer on FlexAttention compiles at its first step, and again with dynamic shapes at its second)
GPU_PLANS = (
    BenchPlan("qwen2.5-0.5b", lora=False, pairs_per_batch=8, max_length=1024, warmup=3, steps=10),
    BenchPlan("llama3.1-8b", lora=True, pairs_per_batch=4, max_length=512, warmup=2, steps=6),
    # Many pairs of one prompt (4 completions paired all ways, 2 prompts a batch): prefix sharing computes each
    # prompt and each completion once
    BenchPlan(
        "qwen2.5-0.5b", False, 12, 1024, 3, 10, "trl_default", prefix_sharing="true", distribution="prompt_groups"
    ),
    BenchPlan("gpt-oss-4-layers", False, 8, 1024, 3, 6, precision="trl_default", prefix_sharing="none"),
    BenchPlan("gemma2-9b-4-layers", False, 8, 1024, 3, 6, precision="trl_default", prefix_sharing="none"),
)
# The same plans on tiny shapes of the same architectures, in the same order, one measured step per mode; the first
# with a warm-up step per mode, so the dry run takes the warm-up path too
DRY_RUN_PLANS = (
    BenchPlan("tiny", lora=False, pairs_per_batch=2, max_length=32, warmup=1, steps=1),
    BenchPlan("tiny", lora=True, pairs_per_batch=2, max_length=32, warmup=0, steps=1),
    BenchPlan(
        "tiny", False, 6, 64, 0, 1, precision="trl_default", prefix_sharing="true", distribution="prompt_groups"
    ),
    BenchPlan("gpt-oss-tiny", False, 2, 32, 0, 1, precision="trl_default", prefix_sharing="none"),
    BenchPlan("gemma2-tiny", False, 2, 32, 0, 1, precision="trl_default", prefix_sharing="none"),
)


@dataclass
class Stage:
    name: str
    status: str  # running, passed, failed or skipped
    seconds: float = 0.0
    detail: str = ""  # the pytest summary, an error's line, or why a stage was skipped


class BudgetSpent(BaseException):
    """Raised in the main thread when a stage runs past its deadline: a BaseException, so that no `except Exception`
    in the code the stage runs swallows it."""


@contextlib.contextmanager
def deadline_alarm(seconds: float) -> Iterator[None]:
    """Raise `BudgetSpent` in the main thread once `seconds` have passed (SIGALRM). Python runs the handler between
    bytecodes: a kernel launch or a synchronisation in progress finishes first."""

    def stop(signum, frame):
        raise BudgetSpent

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Report:
    """What the report holds, rewritten to `out` whenever a stage starts or ends and whenever a row lands."""

    out: Path
    command: str
    dry_run: bool
    device: dict = field(default_factory=dict)  # the machine: name, and on CUDA driver, SM, memory
    versions: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    stages: list[Stage] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)  # per model, precision and mode
    profiles: list[dict] = field(default_factory=list)
    padded_attention: dict[str, dict] = field(default_factory=dict)  # per model: padded TRL's attention, and why
    bench_commands: list[str] = field(default_factory=list)
    bench_rows: list[dict] = field(default_factory=list)  # the bench's own rows, every field
    context_parallel: dict = field(default_factory=dict)  # each rank's compute, static against dynamic

    def run_stage(self, name: str, work: Callable[[], object], deadline: float):
        """`work()`'s result, or None when it failed, ran past `deadline` (time.monotonic) or would start after it;
        recorded either way. A string result is the stage's detail line."""
        if time.monotonic() >= deadline:
            self.record(Stage(name, "skipped", detail=f"would start past its deadline ({self.budget_line})"))
            return None
        stage = Stage(name, "running")
        self.record(stage)
        start = time.monotonic()
        try:
            with deadline_alarm(deadline - start):
                result = work()
        except BudgetSpent:
            self.finish(stage, "failed", start, f"stopped at its deadline ({self.budget_line})")
            return None
        except Exception as error:  # recorded, and the next stage runs
            with (self.out / "errors.log").open("a") as log:
                log.write(f"== {name}\n{traceback.format_exc()}\n")
            self.finish(stage, "failed", start, " ".join(f"{type(error).__name__}: {error}".split())[:300])
            return None
        self.finish(stage, "passed", start, result if isinstance(result, str) else "")
        return result

    @property
    def budget_line(self) -> str:
        return f"budget {TIME_BUDGET_S} s, the GPU tests' last {PYTEST_SLICE_S} s of it"

    def deadline(self, stage_kind: str) -> float:
        """When stages of `stage_kind` must end: the GPU tests at the budget, every other stage its slice earlier."""
        return self.started + TIME_BUDGET_S - (0 if stage_kind == "pytest" else PYTEST_SLICE_S)

    def record(self, stage: Stage) -> None:
        self.stages.append(stage)
        self.write()

    def finish(self, stage: Stage, status: str, start: float, detail: str) -> None:
        stage.status, stage.seconds, stage.detail = status, time.monotonic() - start, detail
        self.write()

    def add_rows(self, rows: list[dict], bench_rows: list[BenchRow]) -> None:
        self.rows += rows
        self.bench_rows += [asdict(row) for row in bench_rows]
        self.write()

    def add_profile(self, profile_summary: dict) -> None:
        self.profiles.append(profile_summary)
        self.write()

    def write(self) -> None:
        """Both files, each written whole to a temporary name and renamed: a kill leaves the previous or the new."""
        data = {key: value for key, value in asdict(self).items() if key not in ("out", "started")}
        data["wall_s"] = time.monotonic() - self.started
        for name, text in (
            ("gpu_report.json", json.dumps(data, indent=2) + "\n"),
            ("gpu_report.md", format_markdown(self, data["wall_s"])),
        ):
            temporary = self.out / f".{name}.tmp"
            temporary.write_text(text)
            temporary.replace(self.out / name)


# ---------------------------------------------------------------------------------------------------------------------
# Stages


def open_device(report: Report, dry_run: bool) -> torch.device:
    """The device the benches run on, described in the report: set up as `trl-padfree bench` does (a waiting host
    thread sleeps, asked before any CUDA context exists)."""
    device, _ = bench_device("cpu" if dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run with --dry-run on a machine without a GPU")
    report.device = device_facts(device)
    return device


def device_facts(device: torch.device) -> dict:
    """The device's name; on CUDA its driver, SM (compute capability), memory, and whether a waiting host thread
    sleeps (what makes host time mean host work)."""
    if device.type != "cuda":
        return dict(name=device_name(device))
    properties = torch.cuda.get_device_properties(device)
    return dict(
        name=properties.name,
        driver=nvidia_driver_version(device.index or 0),
        sm=f"{properties.major}.{properties.minor}",
        memory_gib=round(properties.total_memory / 2**30, 1),
        cuda_runtime=torch.version.cuda,
        blocking_sync=cuda_sync_blocks(device),
    )


def nvidia_driver_version(index: int) -> str:
    """The driver's version as nvidia-smi prints it; else the CUDA version the driver supports (libcuda)."""
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(index)]
        found = subprocess.run(query, capture_output=True, text=True, timeout=30)
        if found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"supports CUDA {version.value // 1000}.{version.value % 1000 // 10} (nvidia-smi not found)"
    except OSError:
        pass
    return "unknown"


def measure_context_parallel(report: Report, dry_run: bool, device: torch.device) -> str:
    """Each rank's compute of a context-parallel step, static against dynamic, recorded; the ratios as the detail."""
    compute = gpu_context_parallel_compute
    report.context_parallel = result = compute.measure(compute.DRY_RUN_PLAN if dry_run else compute.GPU_PLAN, device)
    report.write()
    return f"static / dynamic compute {result['measured_ratio']:.2f}x (cost model {result['predicted_ratio']:.2f}x)"


def bench_plan(report: Report, plan: BenchPlan, device: torch.device) -> None:
    """Build, bench and profile one plan, precision by precision, each precision's trainers released after."""
    options = build_parser("bench").parse_args(["bench", *plan.bench_args(device.type)])
    set_step_counts(options)
    report.bench_commands.append(shlex.join(["trl-padfree", "bench", *plan.bench_args(device.type)]))
    report.padded_attention[plan.model] = asdict(padded_attention(plan.model))
    deadline = report.deadline("bench")
    for precision in bench_precisions(options.precision, device):
        name = f"{plan.label} {precision.name}"
        trainers = report.run_stage(
            f"build {name}", functools.partial(build_trainers, options, precision, device), deadline
        )
        if trainers is None:
            continue
        bench = functools.partial(bench_and_record, report, plan, trainers, options, device, precision)
        report.run_stage(f"bench {name}", bench, deadline)
        profiles = functools.partial(profile_modes, report, plan, precision, trainers, options, device)
        report.run_stage(f"profile {name}", profiles, deadline)
        del trainers
        release_memory(device)


def bench_and_record(
    report: Report,
    plan: BenchPlan,
    trainers: dict,
    options: argparse.Namespace,
    device: torch.device,
    precision: BenchPrecision,
) -> None:
    """The precision's rows, written as soon as they are measured (before the stage is recorded passed)."""
    rows = bench_trainers(trainers, options, device, precision)
    report.add_rows(step_rows(plan, rows), rows)


def step_rows(plan: BenchPlan, rows: list[BenchRow]) -> list[dict]:
    """One row per mode, padded TRL's first (its speedup 1; it never calls the varlen kernel: none counted)."""
    first = rows[0]
    common = dict(
        model=plan.label,
        precision=first.precision,
        activation_checkpointing=first.activation_checkpointing,
        warmup_steps=first.warmup_steps,
    )
    padded = dict(
        common,
        mode="padded",
        attention=first.padded_attention,
        **_times(first.padded_step_times_s, first.padded_host_times_s, first.padded_host_bound),
        real_tokens_per_s=first.real_tokens / sum(first.padded_step_times_s),
        speedup=1.0,
        flop_ideal_speedup=None,
        fraction_of_flop_ideal=None,
        varlen_calls_per_attention_call=None,
        shared_batches=None,
        peak_mem_mb=first.padded_peak_mem_mb,
    )
    return [padded] + [
        dict(
            common,
            mode=row.backend,
            attention="padfree_varlen",
            **_times(row.padfree_step_times_s, row.padfree_host_times_s, row.padfree_host_bound),
            real_tokens_per_s=row.real_tokens_per_s,
            speedup=row.speedup,
            flop_ideal_speedup=row.flop_ideal_speedup,
            fraction_of_flop_ideal=row.fraction_of_flop_ideal,
            varlen_calls_per_attention_call=row.varlen_calls_per_attention_call,
            shared_batches=row.shared_batches,
            peak_mem_mb=row.padfree_peak_mem_mb,
        )
        for row in rows
    ]


def _times(step_times_s: list[float], host_times_s: list[float], host_bound: bool | None) -> dict:
    """A mode's measured steps: mean, median and spread, and host CPU time per step."""
    return dict(
        step_s=statistics.fmean(step_times_s),
        step_s_median=statistics.median(step_times_s),
        step_s_min=min(step_times_s),
        step_s_max=max(step_times_s),
        steps=len(step_times_s),
        host_s=statistics.fmean(host_times_s),
        host_bound=host_bound,
    )


def run_gpu_tests(out: Path) -> str:
    """The GPU tests in a process of their own, the log in `out`; their summary line, or an error with it. Stopped
    at the stage's deadline (`BudgetSpent`), or any interruption, with every process they started."""
    log_path = out / "pytest.log"
    environment = {**os.environ, "TQDM_DISABLE": "1"}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, *PYTEST_COMMAND[1:]],
            cwd=ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = process.wait()
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: pytest and any process it started
                process.wait()
    lines = log_path.read_text().strip().splitlines()
    summary = lines[-1].strip("= ") if lines else "no output"
    if returncode:  # 5 included: no GPU test collected
        raise RuntimeError(f"exit status {returncode}: {summary}")
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# Profiles


def profile_modes(
    report: Report,
    plan: BenchPlan,
    precision: BenchPrecision,
    trainers: dict,
    options: argparse.Namespace,
    device: torch.device,
) -> None:
    """One profiled step per mode, on the same batch (the first of the bench's batches), each written as it lands."""
    vocab_size = len(load_demo_tokenizer())
    batch = make_batches(
        options.distributions[0], 1, options.pairs_per_batch, options.max_length, vocab_size, options.seed
    )[0]
    for mode, trainer in trainers.items():
        summary = profile_step(trainer, batch, device)
        report.add_profile(dict(model=plan.label, precision=precision.name, mode=mode or "padded", **summary))


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
    rest of the span. Host time: the CPU time of operators and CUDA runtime calls on every thread (each event's own,
    so nested calls count once). Without device events (CPU), the top operators by their own CPU time."""
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


HOST_TIME_NOTE = (
    "host s/step: the process's CPU time over the step, every thread (Python's, and autograd's device thread, which "
    f"launches the backward's kernels on CUDA); **host-bound**: at least {HOST_BOUND_FRACTION:.0%} of the step's "
    "time, so the GPU waited on the host. Marked on CUDA only, and only where the driver puts a waiting thread to "
    "sleep (blocking sync), so waiting is not counted as work; the profiles' GPU idle share measures the same from "
    "the other side."
)
STEP_COLUMNS = ("model", "precision", "mode", "attention", "warm-up + measured", "s/step (mean)")
STEP_COLUMNS += ("median (min-max)", "host s/step", "real tokens/s", "speedup over padded", "FLOP ideal")
STEP_COLUMNS += ("of FLOP ideal", "varlen calls / attention call", "batches shared", "peak MB")


def format_markdown(report: Report, wall_s: float) -> str:
    lines = [
        "# GPU report" + (" (dry run on CPU)" if report.dry_run else ""),
        "",
        "- device: " + device_line(report.device),
        "- versions: " + ", ".join(f"{name} {version}" for name, version in report.versions.items()),
        f"- command: `{report.command}` ({wall_s:.0f} s, {report.budget_line})",
        *(f"- bench: `{command}`" for command in report.bench_commands),
        checkpointing_line(report.rows),
        *(
            f"- padded TRL on {model}: `{choice['implementation']}` ({choice['why']})"
            for model, choice in report.padded_attention.items()
        ),
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
        HOST_TIME_NOTE,
        "",
        "## One profiled step per mode",
    ]
    for summary in report.profiles:
        lines += ["", *profile_lines(summary)]
    if report.context_parallel:
        lines += ["", "## Context parallelism: each rank's compute, static against dynamic", ""]
        lines += gpu_context_parallel_compute.markdown_lines(report.context_parallel)
    return "\n".join(lines) + "\n"


def device_line(facts: dict) -> str:
    if "sm" not in facts:
        return facts.get("name", "not opened yet")
    return (
        f"{facts['name']} (SM {facts['sm']}, {facts['memory_gib']} GiB; driver {facts['driver']}, CUDA runtime "
        f"{facts['cuda_runtime']}; a waiting host thread {'sleeps' if facts['blocking_sync'] else 'spins'})"
    )


def checkpointing_line(rows: list[dict]) -> str:
    if all(row["activation_checkpointing"] for row in rows):
        return "- every mode with activation checkpointing on, as TRL's `DPOConfig` has it (`gradient_checkpointing`)"
    off = sorted({row["model"] for row in rows if not row["activation_checkpointing"]})
    return f"- activation checkpointing off for {', '.join(off)}; on elsewhere (TRL's default)"


def step_cells(row: dict) -> list[str]:
    calls, peak, ideal = row["varlen_calls_per_attention_call"], row["peak_mem_mb"], row["flop_ideal_speedup"]
    return [
        row["model"],
        row["precision"],
        row["mode"],
        row["attention"],
        f"{row['warmup_steps']} + {row['steps']}",
        f"{row['step_s']:.3f}",
        f"{row['step_s_median']:.3f} ({row['step_s_min']:.3f}-{row['step_s_max']:.3f})",
        f"{row['host_s']:.3f}" + (" **host-bound**" if row["host_bound"] else ""),
        f"{row['real_tokens_per_s']:,.0f}",
        f"{row['speedup']:.2f}x",
        "-" if ideal is None else f"{ideal:.2f}x",
        "-" if ideal is None else f"{row['fraction_of_flop_ideal']:.0%}",
        "-" if calls is None else f"{calls:.2f}",
        "-" if row["shared_batches"] is None else f"{row['shared_batches']}/{row['steps']}",
        "n/a" if peak is None else f"{peak:,.0f}",
    ]


def profile_lines(summary: dict) -> list[str]:
    title = f"### {summary['model']}, {summary['precision']}, {summary['mode']}"
    if summary["gpu_idle_share"] is None:
        gaps = f"step {summary['span_ms']:.1f} ms, host {summary['host_ms']:.1f} ms, no CUDA kernel"
    else:
        gaps = (
            f"step {summary['span_ms']:.1f} ms; GPU busy {summary['gpu_busy_ms']:.1f} ms, idle "
            f"{summary['gpu_idle_share']:.0%} of the step; host (operators, CUDA runtime) "
            f"{summary['host_ms']:.1f} ms, kernels {summary['kernel_ms']:.1f} ms"
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
    device = report.run_stage(
        "device", functools.partial(open_device, report, args.dry_run), report.deadline("device")
    )
    if device is not None:
        slice_end = min(report.deadline("bench"), time.monotonic() + CONTEXT_PARALLEL_SLICE_S)
        context_parallel = functools.partial(measure_context_parallel, report, args.dry_run, device)
        report.run_stage("context parallel compute", context_parallel, slice_end)
        release_memory(device)
    for plan in (DRY_RUN_PLANS if args.dry_run else GPU_PLANS) if device is not None else ():
        bench_plan(report, plan, device)
    if args.dry_run:
        report.record(Stage("pytest", "skipped", detail=f"dry run; on a GPU: {shlex.join(PYTEST_COMMAND)}"))
    else:
        release_memory(device or torch.device("cpu"))  # the GPU tests run in a process of their own
        report.run_stage("pytest", functools.partial(run_gpu_tests, out), report.deadline("pytest"))
    report.write()
    print(f"wrote {out / 'gpu_report.md'} and {out / 'gpu_report.json'}")
    return int(any(stage.status == "failed" for stage in report.stages))


if __name__ == "__main__":
    sys.exit(main())
