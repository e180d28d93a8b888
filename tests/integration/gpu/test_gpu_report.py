"""tools/gpu_report.py: its dry run on CPU (tiny shapes of the GPU run's plans, in its order, one measured step per
mode) through the strict stand-in of torch's varlen kernel, so the packed forward takes its CUDA branch: both
reports with a row per plan, precision and mode, written as each lands, activation checkpointing on as in TRL's
defaults, one allocator reset before every mode's warm-ups; a run killed mid-stage; a stage stopped at its deadline;
and the profile's host gaps on hand-made kernel events (no GPU here)."""

import argparse
import functools
import json
import os
import signal
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from stand_in_kernels import varlen_stand_in
from torch.autograd import DeviceType

from tools import gpu_report
from trl_padfree.cli.bench import harness
from trl_padfree.cli.bench.harness import make_bench_model
from trl_padfree.cli.bench.rows import PREFIX_SHARING, PREFIX_SHARING_AUTO, measure_steps
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.tiny import DEMO_MODEL_SIZES

PRECISIONS = {"both": ("trl_default", "bf16"), "trl_default": ("trl_default",)}
MODES = {
    "auto": ("padded", "padfree_varlen", PREFIX_SHARING_AUTO),
    "true": ("padded", "padfree_varlen", PREFIX_SHARING),
    "none": ("padded", "padfree_varlen"),
}


@pytest.fixture
def dry_run_machine(monkeypatch):
    """The dry run's models built once before the stand-in (their modules imported), on one intra-op thread: tiny
    steps gain nothing from more, and on a shared machine the threads only contend. The per-step full garbage
    collection is skipped (seconds in a test process)."""
    for plan in gpu_report.DRY_RUN_PLANS:
        make_bench_model(plan.model, "eager", torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(harness.gc, "collect", lambda: 0)
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        yield
    torch.set_num_threads(threads)


def _on_disk(out) -> tuple[dict, str]:
    return json.loads((out / "gpu_report.json").read_text()), (out / "gpu_report.md").read_text()


def test_dry_run_benches_the_plans_in_order_with_checkpointing_on(tmp_path, dry_run_machine, monkeypatch):
    log = []  # allocator resets and steps, in order
    release_cached, timed_step = harness.PeakMemory.release_cached, harness.timed_step
    monkeypatch.setattr(harness.PeakMemory, "release_cached", lambda self: log.append("reset") or release_cached(self))
    monkeypatch.setattr(
        harness, "timed_step", lambda trainer, *args: log.append(trainer) or timed_step(trainer, *args)
    )
    assert gpu_report.main(["--out", str(tmp_path), "--dry-run"]) == 0

    report, markdown = _on_disk(tmp_path)
    assert report["dry_run"] and report["device"]["name"].startswith("cpu")
    assert {"torch", "transformers", "trl", "peft", "commit"} <= report["versions"].keys()
    plans = gpu_report.DRY_RUN_PLANS
    # Headline shapes first, then prompt groups, then the attention varlen cannot compute; the GPU tests last, in their
    # own slice
    assert [plan.model for plan in gpu_report.GPU_PLANS][:2] == ["qwen2.5-0.5b", "llama3.1-8b"]
    assert gpu_report.GPU_PLANS[2].distribution == "prompt_groups" == plans[2].distribution
    for dry, gpu in zip(plans, gpu_report.GPU_PLANS, strict=True):  # the dry run takes the GPU run's paths
        assert (dry.lora, dry.precision, dry.prefix_sharing) == (gpu.lora, gpu.precision, gpu.prefix_sharing)
        dry_type = harness.MODEL_SHAPES.get(dry.model, {}).get("model_type")  # None: the demo Llama
        assert dry_type in (None, harness.MODEL_SHAPES[gpu.model]["model_type"])
    expected = ["device"] + [
        f"{stage} {plan.label} {precision}"
        for plan in plans
        for precision in PRECISIONS[plan.precision]
        for stage in ("build", "bench", "profile")
    ]
    stages = report["stages"]
    assert [stage["name"] for stage in stages] == [expected[0], "context parallel compute", *expected[1:], "pytest"]
    assert all(stage["status"] == "passed" for stage in stages[:-1]), stages
    assert stages[-1]["status"] == "skipped" and "pytest -m gpu" in stages[-1]["detail"]

    rows = {(row["model"], row["precision"], row["mode"]): row for row in report["rows"]}
    assert len(rows) == len(report["rows"]) and set(rows) == {
        (plan.label, precision, mode)
        for plan in plans
        for precision in PRECISIONS[plan.precision]
        for mode in MODES[plan.prefix_sharing]
    }
    for (_, _, mode), row in rows.items():
        assert row["activation_checkpointing"] is True  # TRL's default, in every mode
        assert row["step_s_min"] <= row["step_s_median"] <= row["step_s_max"] and row["host_s"] > 0
        assert row["real_tokens_per_s"] > 0 and row["peak_mem_mb"] > 0 and row["host_bound"] is None  # CPU
        if mode == "padded":
            assert row["varlen_calls_per_attention_call"] is None and row["flop_ideal_speedup"] is None
        else:  # the kernel calls, whatever path the layer takes (1.0 on the kernel; 0 where none is called)
            assert 0 <= row["varlen_calls_per_attention_call"] <= 1 and row["fraction_of_flop_ideal"] > 0
        assert (row["shared_batches"] is None) == (mode not in (PREFIX_SHARING, PREFIX_SHARING_AUTO))
    # Under the stand-in both precisions reach the kernel: TRL's default casts float32 queries and keys to bf16
    assert rows[("tiny", "trl_default", "padfree_varlen")]["varlen_calls_per_attention_call"] == 1.0
    assert rows[("tiny", "bf16", PREFIX_SHARING_AUTO)]["varlen_calls_per_attention_call"] == 1.0
    # Checkpointing really ran: each layer's attention again in the backward (policy, recompute, reference)
    for bench_row in report["bench_rows"]:
        shape = harness.MODEL_SHAPES.get(bench_row["model"]) or DEMO_MODEL_SIZES[bench_row["model"]]
        assert bench_row["activation_checkpointing"] and bench_row["attention_calls"] == 3 * shape["num_hidden_layers"]
    attention = report["padded_attention"]
    assert attention["tiny"]["implementation"] == "sdpa" and attention["gpt-oss-tiny"]["implementation"] == "eager"
    assert "vllm-flash-attn3" in attention["gpt-oss-tiny"]["why"]
    assert attention["gemma2-tiny"]["implementation"] in ("eager", "flash_attention_2")
    profiles = {(entry["model"], entry["precision"], entry["mode"]) for entry in report["profiles"]}
    assert profiles == set(rows)
    assert all(entry["top"] and entry["gpu_idle_share"] is None for entry in report["profiles"])  # CPU: no kernels

    # One allocator reset per bench, before the warm-ups of every mode (the first plan warms up one step per mode)
    benches = [index for index, entry in enumerate(log) if entry == "reset"]
    assert len(benches) == sum(len(PRECISIONS[plan.precision]) for plan in plans)
    first_bench = log[benches[0] + 1 : benches[1]]
    modes = len(MODES[plans[0].prefix_sharing])
    warm_ups, measured = first_bench[:modes], first_bench[modes:]
    assert len(set(map(id, warm_ups))) == modes and len(measured) == modes * plans[0].steps
    assert {id(trainer) for trainer in measured} == {id(trainer) for trainer in warm_ups}

    assert "| model | precision | mode | attention | warm-up + measured |" in markdown
    assert "| FLOP ideal | of FLOP ideal | varlen calls / attention call | batches shared | peak MB |" in markdown
    assert "| tiny | trl_default | padfree_varlen | padfree_varlen | 1 + 1 |" in markdown
    assert "| tiny (LoRA) | bf16 | padded | sdpa | 0 + 1 |" in markdown
    assert "| gpt-oss-tiny | trl_default | padded | eager |" in markdown
    assert "activation checkpointing on, as TRL's `DPOConfig` has it" in markdown and "host-bound" in markdown
    assert "padded TRL on gpt-oss-tiny: `eager`" in markdown
    assert report["command"] in markdown and "trl-padfree bench --model tiny" in markdown

    # Each rank's compute of a context-parallel step, static against dynamic (rows on 1, 2 and 4 ranks), every chunk
    # on the kernel's path (the stand-in's)
    context_parallel = report["context_parallel"]
    static, dynamic = context_parallel["static"], context_parallel["dynamic"]
    assert static["rows_by_ranks"] == {"1": 0, "2": 0, "4": static["micro_steps"]}
    assert all(dynamic["rows_by_ranks"].values())
    for layout in (static, dynamic):
        assert layout["seconds"] > 0 and layout["predicted_flops"] > 0
        assert layout["varlen_calls_per_attention_call"] == 1.0
    assert context_parallel["measured_ratio"] > 0 and context_parallel["predicted_ratio"] > 0
    assert "## Context parallelism: each rank's compute, static against dynamic" in markdown
    assert "static / dynamic compute: measured" in markdown and "not measured" in markdown


def test_a_run_killed_mid_stage_keeps_every_row_measured_before(tmp_path, dry_run_machine, monkeypatch):
    """Killed during the second profile: the bench's rows and the first profile are on disk at that moment, in both
    files, and the stage in progress reads running."""
    monkeypatch.setattr(gpu_report, "DRY_RUN_PLANS", (replace(gpu_report.DRY_RUN_PLANS[0], precision="bf16"),))
    seen = []
    profile_step = gpu_report.profile_step

    def killed_at_the_second(trainer, batch, device):
        seen.append(_on_disk(tmp_path))
        if len(seen) == 2:
            raise KeyboardInterrupt  # as a kill would stop it: nothing after this line runs
        return profile_step(trainer, batch, device)

    monkeypatch.setattr(gpu_report, "profile_step", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        gpu_report.main(["--out", str(tmp_path), "--dry-run"])

    (first, _), (second, markdown) = seen
    modes = MODES["auto"]
    assert [row["mode"] for row in first["rows"]] == list(modes) and len(first["bench_rows"]) == len(modes) - 1
    assert {stage["name"]: stage["status"] for stage in first["stages"]}["bench tiny bf16"] == "passed"
    assert first["profiles"] == [] and [entry["mode"] for entry in second["profiles"]] == ["padded"]
    assert "| tiny | bf16 | padfree_varlen |" in markdown and "### tiny, bf16, padded" in markdown
    left, _ = _on_disk(tmp_path)
    assert left["stages"][-1] == dict(name="profile tiny bf16", status="running", seconds=0.0, detail="")
    assert left["rows"] == first["rows"] and left["profiles"] == second["profiles"]


def test_a_stage_past_its_deadline_is_stopped_and_the_next_skipped(tmp_path):
    report = gpu_report.Report(tmp_path, "gpu_report.py", dry_run=True)
    handler = signal.getsignal(signal.SIGALRM)
    swallowing = lambda: [_swallow_errors(time.sleep, 30) for _ in range(2)]  # noqa: E731
    start = time.monotonic()
    assert report.run_stage("slow", swallowing, deadline=start + 0.2) is None
    assert time.monotonic() - start < 5  # stopped in the first sleep, through the code's own `except Exception`
    assert report.run_stage("next", lambda: "ran", deadline=start + 0.2) is None
    assert report.run_stage("later", lambda: "ran", deadline=time.monotonic() + 60) == "ran"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the alarm disarmed, its handler restored
    assert signal.getsignal(signal.SIGALRM) is handler
    stages, _ = _on_disk(tmp_path)
    assert [(stage["name"], stage["status"]) for stage in stages["stages"]] == [
        ("slow", "failed"),
        ("next", "skipped"),
        ("later", "passed"),
    ]
    assert "stopped at its deadline" in stages["stages"][0]["detail"]
    assert "would start past its deadline" in stages["stages"][1]["detail"]
    # The GPU tests' slice comes after every bench's deadline
    assert report.deadline("pytest") - report.deadline("bench") == gpu_report.PYTEST_SLICE_S


def test_the_gpu_tests_stopped_at_their_deadline_leave_no_process(tmp_path, monkeypatch):
    started = []
    popen = gpu_report.subprocess.Popen
    monkeypatch.setattr(gpu_report, "PYTEST_COMMAND", ("python", "-c", "import time; time.sleep(60)"))
    monkeypatch.setattr(
        gpu_report.subprocess, "Popen", lambda *args, **kwargs: started.append(popen(*args, **kwargs)) or started[-1]
    )
    report = gpu_report.Report(tmp_path, "gpu_report.py", dry_run=False)
    tests = functools.partial(gpu_report.run_gpu_tests, tmp_path)
    assert report.run_stage("pytest", tests, deadline=time.monotonic() + 0.5) is None
    (process,) = started
    assert process.returncode == -signal.SIGKILL and report.stages[0].status == "failed"


def test_the_report_names_the_gpu_its_driver_and_sm(tmp_path, monkeypatch):
    properties = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=150_000_000_000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    monkeypatch.setattr(gpu_report, "cuda_sync_blocks", lambda device: True)
    smi = SimpleNamespace(returncode=0, stdout="570.86.15\n")
    monkeypatch.setattr(gpu_report.subprocess, "run", lambda command, **kwargs: smi)
    report = gpu_report.Report(tmp_path, "gpu_report.py", dry_run=False)
    report.device = gpu_report.device_facts(torch.device("cuda", 0))
    assert report.device["sm"] == "9.0" and report.device["driver"] == "570.86.15"
    report.write()
    _, markdown = _on_disk(tmp_path)
    assert "- device: NVIDIA H200 (SM 9.0, 139.7 GiB; driver 570.86.15" in markdown


def _swallow_errors(function, *args):
    try:
        function(*args)
    except Exception:  # what code under a stage may do: the deadline still stops it
        pass


def test_the_script_runs_from_the_checkout_offline():
    assert str(gpu_report.ROOT) in sys.path and os.environ["HF_HUB_OFFLINE"] == "1"


class _FakeCudaEvent:
    def __init__(self, log):
        self.log = log

    def record(self):
        self.log.append("event")

    def elapsed_time(self, other):
        return 2.0


class _FakeTrainer:
    def __init__(self, log, name):
        self.log, self.name = log, name
        self.model = torch.nn.Linear(1, 1)
        self.data_collator = lambda batch: batch

    def training_step(self, model, inputs):
        self.log.append(self.name)


def test_cuda_allocator_is_emptied_once_before_every_modes_warm_ups(monkeypatch):
    """The bench's CUDA path with CUDA's calls logged: `empty_cache` once, then every mode's warm-ups, then the
    measured steps; the peak statistics reset before every step, warm-up or measured."""
    log = []
    fakes = dict(
        empty_cache=lambda: log.append("empty_cache"),
        synchronize=lambda device=None: None,
        reset_peak_memory_stats=lambda device=None: log.append("reset_peak"),
        max_memory_allocated=lambda device=None: 3 * 2**20,
        Event=lambda enable_timing=False: _FakeCudaEvent([]),
    )
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(harness, "cuda_sync_blocks", lambda device: True)
    monkeypatch.setattr(harness.gc, "collect", lambda: 0)
    modes = (None, "padfree_varlen", PREFIX_SHARING_AUTO)
    trainers = {mode: _FakeTrainer(log, mode or "padded") for mode in modes}
    options = argparse.Namespace(warmup=2, batches=3, pairs_per_batch=2, max_length=32, seed=0)
    measure_steps("ultrafeedback", trainers, options, torch.device("cuda"))

    step = lambda mode: ["reset_peak", mode]  # noqa: E731
    warm_ups = [entry for mode in ("padded", "padfree_varlen", PREFIX_SHARING_AUTO) for entry in step(mode) * 2]
    assert log[: 1 + len(warm_ups)] == ["empty_cache", *warm_ups]
    assert log.count("empty_cache") == 1 and log.count("reset_peak") == 3 * (2 + 3)


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
