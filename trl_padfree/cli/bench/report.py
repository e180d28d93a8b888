"""The text bench's report: the speedup table (one line per precision, distribution and padding-free mode, against
padded TRL), the step table (each mode's measured steps: spread, host time, FLOPs), the JSON rows and the plot."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from .harness import format_peak_mb, markdown_table
from .rows import BenchRow

TABLE_COLUMNS = (
    "precision",
    "distribution",
    "backend",
    "padded s/step",
    "padding-free s/step",
    "speedup",
    "per-batch speedup (min-max)",
    "token ideal",
    "of token ideal",
    "FLOP ideal",
    "of FLOP ideal",
    "host s/step padded",
    "host s/step padding-free",
    "peak MB padded",
    "peak MB padding-free",
    "real tokens/s",
    "varlen calls / attention call",
    "sharing vs unshared (ideal), batches shared",
)
STEP_TABLE_COLUMNS = (
    "precision",
    "distribution",
    "mode",
    "warm-up + measured",
    "median s",
    "min s",
    "max s",
    "mean s",
    "host s (mean)",
    "host / step",
    "GFLOP/step",
    "GFLOP/s",
)


def format_conditions(rows: list[BenchRow]) -> str:
    """One line under which the rows ran: activation checkpointing, and padded TRL's attention."""
    checkpointing = {row.activation_checkpointing for row in rows}
    states = " and ".join("on (TRL's default)" if on else "off" for on in sorted(checkpointing, reverse=True))
    attention = ", ".join(sorted({row.padded_attention for row in rows}))
    return f"Activation checkpointing {states} in every mode; padded TRL's attention: {attention}."


def format_table(rows: list[BenchRow]) -> str:
    """The speedup table: one line per precision, distribution and padding-free mode, against padded TRL in the
    same precision."""
    cells = (
        [
            row.precision,
            row.distribution,
            row.backend,
            f"{row.padded_step_s:.3f}",
            f"{row.padfree_step_s:.3f}",
            f"{row.speedup:.2f}x",
            f"{row.speedup_per_batch_min:.2f}-{row.speedup_per_batch_max:.2f}x",
            f"{row.ideal_speedup:.2f}x",
            f"{row.fraction_of_ideal:.0%}",
            f"{row.flop_ideal_speedup:.2f}x",
            f"{row.fraction_of_flop_ideal:.0%}",
            _host_cell(row.padded_host_step_s, row.padded_host_bound),
            _host_cell(row.padfree_host_step_s, row.padfree_host_bound),
            format_peak_mb(row.padded_peak_mem_mb),
            format_peak_mb(row.padfree_peak_mem_mb),
            f"{row.real_tokens_per_s:,.0f}",
            f"{row.varlen_calls_per_attention_call:.2f}",
            _sharing_cell(row),
        ]
        for row in rows
    )
    return markdown_table(TABLE_COLUMNS, cells)


def format_step_table(rows: list[BenchRow]) -> str:
    """Per precision, distribution and mode (padded TRL once): the spread of its measured steps, host time, FLOPs."""
    cells = []
    for index, row in enumerate(rows):
        first = index == 0 or (rows[index - 1].precision, rows[index - 1].distribution) != (
            row.precision,
            row.distribution,
        )
        modes = [("padded", "padded")] if first else []
        for mode, prefix in [*modes, (row.backend, "padfree")]:
            times = getattr(row, f"{prefix}_step_times_s")
            flops = getattr(row, f"{prefix}_step_flops")
            host = getattr(row, f"{prefix}_host_step_s")
            cells.append(
                [
                    row.precision,
                    row.distribution,
                    mode,
                    f"{row.warmup_steps} + {len(times)}",
                    f"{statistics.median(times):.3f}",
                    f"{min(times):.3f}",
                    f"{max(times):.3f}",
                    f"{statistics.fmean(times):.3f}",
                    _host_cell(host, getattr(row, f"{prefix}_host_bound")),
                    f"{host / statistics.fmean(times):.2f}",
                    f"{flops / 1e9:,.1f}",
                    f"{flops / statistics.fmean(times) / 1e9:,.1f}",
                ]
            )
    return markdown_table(STEP_TABLE_COLUMNS, cells)


def _host_cell(seconds: float, host_bound: bool | None) -> str:
    return f"{seconds:.3f}" + (" host-bound" if host_bound else "")


def _sharing_cell(row: BenchRow) -> str:
    if row.shared_batches is None:
        return ""
    shared = f"{row.shared_batches}/{row.batches} batches shared"
    if row.speedup_over_unshared is None:
        return shared
    return f"{row.speedup_over_unshared:.2f}x ({row.ideal_speedup_over_unshared:.2f}x), {shared}"


def plot(rows: list[BenchRow], path: str) -> None:
    """Bars of measured speedup per distribution and backend (and precision, when several), with the ideal as a line
    over each group."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("--plot needs matplotlib: pip install 'trl-padfree[bench]'") from error
    distributions = list(dict.fromkeys(row.distribution for row in rows))
    series = list(dict.fromkeys((row.backend, row.precision) for row in rows))
    several_precisions = len({precision for _, precision in series}) > 1
    width = 0.8 / len(series)
    figure, axes = plt.subplots(figsize=(2.2 + 1.6 * len(distributions), 3.6))
    for offset, (backend, precision) in enumerate(series):
        values = [
            next(
                (r.speedup for r in rows if r.distribution == d and (r.backend, r.precision) == (backend, precision)),
                0,
            )
            for d in distributions
        ]
        positions = [index - 0.4 + width * (offset + 0.5) for index in range(len(distributions))]
        label = f"padding-free, {backend}" + (f", {precision}" if several_precisions else "")
        axes.bar(positions, values, width, label=label)
    for index, distribution in enumerate(distributions):
        ideal = next(row.ideal_speedup for row in rows if row.distribution == distribution)
        axes.hlines(
            ideal,
            index - 0.45,
            index + 0.45,
            colors="black",
            linestyles="dashed",
            label="ideal" if index == 0 else None,
        )
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xticks(range(len(distributions)), distributions)
    axes.set_ylabel("speedup over padded TRL")
    axes.set_title(f"{rows[0].model} on {rows[0].device}", fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_rows(rows: list, path: str, flags: dict) -> None:
    """The rows (any of the bench's row dataclasses) as JSON, under the run's provenance."""
    report = {"provenance": run_provenance(flags), "rows": [asdict(row) for row in rows]}
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


# Every benchmark file records what a user needs to rerun it: docs/bench/*.json, tests/cli/test_bench_provenance.py
PROVENANCE_PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "peft")


def run_provenance(flags: dict, command: str | None = None) -> dict:
    """What a user needs to reproduce this process's figures: the command that ran (default: this process's), the
    package's version and commit, the versions of torch, transformers, TRL and their neighbours, the device, the date
    and the parsed flags (defaults included)."""
    versions = {"python": platform.python_version()}
    for package in PROVENANCE_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return {
        "command": command or invoked_command(),
        "trl_padfree": importlib.metadata.version("trl-padfree"),
        "commit": checkout_commit(),
        "versions": versions,
        "device": device_description(),
        "date": datetime.date.today().isoformat(),
        "flags": {
            key: value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
            for key, value in sorted(flags.items())
            if not callable(value)
        },  # fmt: skip
        "reproducible": True,
    }


def invoked_command() -> str:
    """This process's command line as a user types it: `trl-padfree ...`, or `python path/to/script.py ...`."""
    program = Path(sys.argv[0])
    if program.suffix == ".py":
        head = ["python", os.path.relpath(program) if program.is_absolute() else str(program)]
    else:
        head = [program.name]
    return shlex.join([*head, *sys.argv[1:]])


def checkout_commit() -> str:
    """The commit of the checkout the package runs from, `+changes` when its files differ from it; `not a checkout`
    for an installed wheel."""
    package_root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package_root, capture_output=True, text=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "trl_padfree", "tools"],
            cwd=package_root,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "not a checkout"
    if commit.returncode:
        return "not a checkout"
    return commit.stdout.strip() + ("+changes" if status.stdout.strip() else "")


def device_description() -> str:
    """The GPUs (name, count) where CUDA is available, else the CPU model and its core count."""
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        return f"{len(names)} x {names[0]}, CUDA {torch.version.cuda}, {os.cpu_count()} CPU cores"
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            model,
        )
    return f"{model}, {len(os.sched_getaffinity(0))} cores, no GPU"
