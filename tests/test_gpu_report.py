"""tools/gpu_report.py: its dry run on CPU (tiny shapes, one step per mode) through the strict stand-in of torch's
varlen kernel, so the packed forward takes its CUDA branch, writes both reports with a row per model, precision and
mode; and the profile's host gaps on hand-made kernel events (no GPU here)."""

import json
from types import SimpleNamespace

import pytest
import torch
from stand_in_kernels import varlen_stand_in
from torch.autograd import DeviceType

from tools import gpu_report
from trl_padfree.cli.bench.harness import make_bench_model
from trl_padfree.cli.bench.rows import PREFIX_SHARING_AUTO
from trl_padfree.modeling.kernels import stand_in_kernels

MODES = ("padded", "padfree_varlen", PREFIX_SHARING_AUTO)
PRECISIONS = ("trl_default", "bf16")


def test_dry_run_writes_a_row_per_precision_and_mode_with_the_kernel_calls(tmp_path):
    make_bench_model("tiny", "sdpa", torch.float32)  # the model's modules imported before the stand-in
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        assert gpu_report.main(["--out", str(tmp_path), "--dry-run"]) == 0

    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["dry_run"] and report["device"].startswith("cpu")
    assert {"torch", "transformers", "trl", "peft", "commit"} <= report["versions"].keys()
    stages = {stage["name"]: stage for stage in report["stages"]}
    assert stages["pytest"]["status"] == "skipped" and "pytest -m gpu" in stages["pytest"]["detail"]
    assert all(stage["status"] == "passed" for name, stage in stages.items() if name != "pytest"), stages
    labels = [plan.label for plan in gpu_report.DRY_RUN_PLANS]
    rows = {(row["model"], row["precision"], row["mode"]): row for row in report["rows"]}
    assert set(rows) == {(label, precision, mode) for label in labels for precision in PRECISIONS for mode in MODES}
    for (_, _, mode), row in rows.items():
        assert row["step_s"] > 0 and row["real_tokens_per_s"] > 0 and row["peak_mem_mb"] > 0
        # Under the stand-in both precisions reach the kernel: TRL's default casts float32 queries and keys to bf16
        assert row["varlen_calls_per_attention_call"] == (None if mode == "padded" else 1.0)
    assert rows[(labels[0], "trl_default", "padfree_varlen")]["varlen_calls_per_attention_call"] == 1.0
    profiles = {(entry["model"], entry["precision"], entry["mode"]) for entry in report["profiles"]}
    assert profiles == set(rows)
    assert all(entry["top"] and entry["gpu_idle_share"] is None for entry in report["profiles"])  # CPU: no kernels

    markdown = (tmp_path / "gpu_report.md").read_text()
    assert "| model | precision | mode | s/step |" in markdown and "| varlen calls / attention call |" in markdown
    assert "| tiny | trl_default | padfree_varlen |" in markdown and "| tiny (LoRA) | bf16 | padded |" in markdown
    assert report["command"] in markdown and "trl-padfree bench --model tiny" in markdown


def _event(name: str, start: float, end: float, device_type=DeviceType.CUDA, self_cpu=0.0, activity="kernel"):
    return SimpleNamespace(
        name=name,
        device_type=device_type,
        activity_type=activity,
        time_range=SimpleNamespace(start=start, end=end),
        self_cpu_time_total=self_cpu,
    )


def test_host_gaps_count_overlapping_kernels_once():
    # A 100 us step: the host works for 100 us; kernels on two streams cover 10-40 and 60-70, overlapping at 20-30;
    # a `record_function` range on the GPU's timeline spans them and is not work
    events = [
        _event("step", 0, 100, DeviceType.CPU, self_cpu=100, activity="cpu_op"),
        _event("gemm", 10, 30),
        _event("gemm", 20, 40),
        _event("softmax", 60, 70),
        _event("forward", 10, 70, activity="gpu_user_annotation"),
    ]
    summary = gpu_report.summarize_events(events)
    assert summary["span_ms"] == pytest.approx(0.1) and summary["gpu_busy_ms"] == pytest.approx(0.04)
    assert summary["gpu_idle_share"] == pytest.approx(0.6)
    assert summary["kernel_ms"] == pytest.approx(0.05) and summary["host_ms"] == pytest.approx(0.1)
    assert summary["top"] == [
        dict(name="gemm", ms=pytest.approx(0.04), calls=2),
        dict(name="softmax", ms=pytest.approx(0.01), calls=1),
    ]
    assert gpu_report.covered_length([(0, 5), (1, 2), (5, 7), (9, 10)]) == 8
