"""Run tests/support/distributed/train_dpo.py in this process (the single-process baseline) or under `accelerate launch`
with DeepSpeed on CPU processes, and read back its JSON report."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tolerances import (
    BF16_ENGINE_LOGPS_RTOL,
    BF16_ENGINE_LOSS_ATOL,
    BF16_ENGINE_MARGIN_ATOL,
    DISTRIBUTED_LOSS_ATOL,
    DISTRIBUTED_METRIC_ATOL,
    DISTRIBUTED_METRIC_RTOL,
    FIRST_LOSS_ATOL,
)

from trl_padfree.data import load_demo_tokenizer
from trl_padfree.tiny import make_demo_model

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = ROOT / "tests" / "support" / "distributed" / "train_dpo.py"
FSDP_ON_CPU = ROOT / "tests" / "support" / "distributed" / "fsdp_on_cpu.py"

COMPARED_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                    "logits/chosen", "logits/rejected", "entropy", "num_tokens", "grad_norm")  # fmt: skip
ACCELERATE_CONFIGS = ROOT / "trl_padfree" / "cli" / "accelerate_configs"


def assert_same_training(report: dict, expected: dict, metric_rtol: float = DISTRIBUTED_METRIC_RTOL) -> None:
    """Every step's loss and compared metrics (grad_norm included) of `report` equal `expected`'s, within the bounds
    (`metric_rtol`: a model's own, measured)."""
    assert report["losses"] == pytest.approx(expected["losses"], abs=DISTRIBUTED_LOSS_ATOL)
    for step, (metrics, expected_metrics) in enumerate(zip(report["metrics"], expected["metrics"], strict=True)):
        for key in COMPARED_METRICS:
            assert metrics[key] == pytest.approx(
                expected_metrics[key], rel=metric_rtol, abs=DISTRIBUTED_METRIC_ATOL
            ), (step, key)


def assert_same_bf16_training(report: dict, expected: dict) -> None:
    """Two bf16 runs, both with float32 log-probs: every step's loss, margin and log-probs within the bf16 bounds."""
    assert report["precision"]["log_probs"] == expected["precision"]["log_probs"] == "torch.float32"
    assert report["losses"] == pytest.approx(expected["losses"], abs=BF16_ENGINE_LOSS_ATOL)
    for step, (metrics, expected_metrics) in enumerate(zip(report["metrics"], expected["metrics"], strict=True)):
        assert metrics["rewards/margins"] == pytest.approx(
            expected_metrics["rewards/margins"], abs=BF16_ENGINE_MARGIN_ATOL
        )
        for key in ("logps/chosen", "logps/rejected"):
            assert metrics[key] == pytest.approx(expected_metrics[key], rel=BF16_ENGINE_LOGPS_RTOL), (step, key)


def assert_split_row_training(report: dict, expected: dict, metric_rtol: float = DISTRIBUTED_METRIC_RTOL) -> None:
    """A run whose rows were split over ranks (sequence or context parallelism) against one process: sequences really
    crossed chunk boundaries, the first loss is ln 2, the training is the same, and tokens a row's ranks share are
    counted once."""
    assert report["sequences_split_across_ranks"] > 0, "no sequence crossed a chunk boundary: nothing was tested"
    assert report["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)
    assert_same_training(report, expected, metric_rtol)
    for step, metrics in enumerate(report["metrics"]):
        new_tokens = metrics["num_tokens"] - (report["metrics"][step - 1]["num_tokens"] if step else 0)
        assert metrics["padfree/real_tokens"] == new_tokens


def assert_no_object_collective(report: dict) -> None:
    """A run launched with `--count-collectives` (tests/support/distributed/step_collectives.py) made no object collective
    (`all_gather_object` and the like: pickling, a host sync) in any training step, its batch hand-out included;
    tests/integration/context_parallel/test_step_collectives.py counts the rest (slow)."""
    steps = report["collectives"]
    assert steps and all(step["tensor"] > 0 for step in steps), "nothing was counted"
    assert [step["object"] for step in steps] == [0] * len(steps), [step["by_caller"] for step in steps]


def save_tiny_model(directory: Path) -> Path:
    """A tiny Llama saved like a checkpoint, so every process (and TRL's reference) loads it by path."""
    make_demo_model("tiny", "llama").save_pretrained(directory)
    load_demo_tokenizer().save_pretrained(directory)
    return directory


def save_tiny_models(directory: Path, model_types) -> Path:
    """One folder per model type under `directory` (tests/support/tiny_architectures.py), for runs named `TYPE:<options>`."""
    from tiny_architectures import save_tiny_architecture

    for model_type in model_types:
        save_tiny_architecture(directory / model_type, model_type)
    return directory


def save_vision_families(tmp_path_factory, name: str, families) -> Path:
    """`families` saved like checkpoints (tests/support/tiny_vision/) in a fresh directory `<name>`, one folder each
    (`<directory>/<family>`, the model and its processor), for runs named `FAMILY:...`."""
    from tiny_vision import save_vision_models

    directory = tmp_path_factory.mktemp(name)
    save_vision_models(directory, families)
    return directory


def train_padded_in_this_process(models_dir: Path, tmp_path_factory, families, pairs_per_step: int, *options) -> dict:
    """TRL's own trainer, padded, in this process, on each of `families` in turn, each micro-batch `pairs_per_step`
    pairs (the micro-batches of the processes it is compared with, together): its report by family."""
    output = tmp_path_factory.mktemp("single") / "report.json"
    runs = ",".join(f"{family}:trl" for family in families)
    reports = train_in_this_process(models_dir, output, "--runs", runs, "--batch-size", str(pairs_per_step), *options)
    return {family: reports[f"{family}:trl"] for family in families}


def single_process_padded_fixture(runs: dict[str, str], *options: str, models: str = "model_dir"):
    """The module fixture `single_process_padded`: TRL's own trainer, padded, in this process, the baseline the
    processes are compared with; each of `runs`' reports (name: run options) by name.

    Args:
        runs: the name each report is returned under, and its run (tests/support/distributed/train_dpo.py `--runs`).
        options: train_dpo.py's other options, its batch size the processes' micro-batches together.
        models: the module fixture of the directory the models are saved in.
    """

    @pytest.fixture(scope="module", name="single_process_padded")
    def single_process_padded(request, tmp_path_factory):
        output = tmp_path_factory.mktemp("single") / "report.json"
        model_dir = request.getfixturevalue(models)
        reports = train_in_this_process(model_dir, output, "--runs", ",".join(runs.values()), *options)
        return {name: reports[run] for name, run in runs.items()}

    return single_process_padded


def checkout_environment(**extra: str) -> dict[str, str]:
    """This process's environment for a subprocess that imports `trl_padfree` from this checkout (ROOT), whichever
    copy of the package is installed, plus `extra`."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *([path] if path else [])]), **extra}


def train_in_this_process(model_dir: Path, output: Path, *options: str) -> dict:
    sys.path.insert(0, str(TRAIN_SCRIPT.parent))
    try:
        import train_dpo
    finally:
        sys.path.pop(0)
    train_dpo.main(["--model", str(model_dir), "--output", str(output), *options])
    return json.loads(output.read_text())


def free_port() -> int:
    """A port nothing listens on now: fixed ports collide with a previous launch's socket still closing."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script_command(config: Path, script: Path) -> list[str]:
    """What `accelerate launch` runs: `script`, or on a machine without CUDA and an FSDP config, `script` through
    tests/support/distributed/fsdp_on_cpu.py (accelerate would otherwise give the CPU processes plain DDP)."""
    if yaml.safe_load(config.read_text())["distributed_type"] == "FSDP" and not torch.cuda.is_available():
        return [str(FSDP_ON_CPU), str(script)]
    return [str(script)]


def train_recipe_to_step_3(config: Path, output_dir: Path, environment: dict[str, str], *extra: str) -> dict:
    """The user's command (trl_padfree/cli/dpo.py, the tiny_cpu.yaml recipe, --ref_offload true) under `accelerate
    launch --config_file config` on 2 CPU processes: 3 steps saving a checkpoint at 2, `extra` its further
    arguments. Returns step 3's logged entry."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
        "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
        *script_command(config, ROOT / "trl_padfree" / "cli" / "dpo.py"),
        "--config", str(ROOT / "trl_padfree" / "cli" / "configs" / "tiny_cpu.yaml"),
        "--model_name_or_path", "trl-padfree/tiny-llama", "--ref_offload", "true", "--eval_strategy", "no",
        "--per_device_train_batch_size", "2", "--max_steps", "3", "--logging_steps", "1",
        "--save_strategy", "steps", "--save_steps", "2", "--output_dir", str(output_dir), *extra,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    state = json.loads((output_dir / "checkpoint-3" / "trainer_state.json").read_text())
    return next(entry for entry in state["log_history"] if entry.get("step") == 3 and "loss" in entry)


def launch(config: str, model_dir: Path, output: Path, *options: str, processes: int = 2) -> dict:
    """`accelerate launch --config_file trl_padfree/cli/accelerate_configs/<config>` over gloo (`DS_ACCELERATOR=cpu`; FSDP
    configs through fsdp_on_cpu.py), multi_gpu.yaml as plain data parallelism on CPU processes."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / config),
        "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port", str(free_port()),
        *script_command(ACCELERATE_CONFIGS / config, TRAIN_SCRIPT),
        "--model", str(model_dir), "--output", str(output), *options,
    ]  # fmt: skip
    environment = checkout_environment(DS_ACCELERATOR="cpu", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    if config == "multi_gpu.yaml":
        # Not `accelerate launch --cpu`: it runs the script in one process, whatever --num_processes says
        environment["ACCELERATE_USE_CPU"] = "true"
    result = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(output.read_text())
