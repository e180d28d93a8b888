"""Recipes: every config parses, `recipes/dpo.py` trains the tiny config end to end (plain python and `accelerate
launch` with two CPU processes), TRL's own script runs with the swapped import, bad input is a one-line error."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from distributed_runs import free_port
from test_cli import assert_one_line_error
from trl import ModelConfig, ScriptArguments, TrlParser

from trl_padfree import DPOConfig
from trl_padfree.data import DATA_DIR

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "dpo.py"
TINY_CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
RECIPE_CONFIGS = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
# The tiny config, made a few seconds long: the smallest model, two steps, no evaluation
QUICK = ["--model_name_or_path", "trl-padfree/tiny-llama", "--max_steps", "2", "--logging_steps", "1"]


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "TRL_PADFREE_CACHE": str(cache), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}


def run(command: list[str], environment: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=environment, cwd=cwd, timeout=600)


def recipe(*args: str, output_dir: Path) -> list[str]:
    return [sys.executable, str(RECIPE), "--config", str(TINY_CONFIG), *QUICK, "--output_dir", str(output_dir), *args]


@pytest.mark.parametrize("config", RECIPE_CONFIGS, ids=lambda path: path.name)
def test_every_recipe_config_parses(config, monkeypatch):
    first_line = config.read_text().splitlines()[0]
    assert first_line.startswith("#"), "each config starts with a comment saying what it runs"
    assert "recipes/dpo.py --config recipes/configs/" + config.name in config.read_text()
    # GPU configs ask for bf16, which the parser refuses on a CPU-only machine
    monkeypatch.setattr(sys, "argv", ["dpo.py", "--config", str(config), "--use_cpu", "true", "--bf16", "false"])
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    assert training_args.padding_free and script_args.dataset_name and model_args.model_name_or_path


def test_recipe_trains_the_tiny_config(tmp_path, environment):
    result = run(recipe("--eval_strategy", "steps", "--eval_steps", "2", output_dir=tmp_path), environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "tokenizer.json").exists()
    assert "padfree/padding_removed" in result.stdout and "eval_padfree/padding_removed" in result.stdout


def test_recipe_under_accelerate_launch_with_two_cpu_processes(tmp_path, environment):
    # Data parallelism over gloo: the multi-GPU config on CPU processes. (`accelerate launch --cpu` would run the
    # script in a single process, whatever --num_processes says.)
    config = ROOT / "recipes" / "accelerate_configs" / "multi_gpu.yaml"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    launch += ["--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port())]
    # Balanced, as the multi-GPU recipes run: the option from the command line, the cost ratio in the logs
    command = recipe("--train_sampling_strategy", "batch_rebalance", output_dir=tmp_path)[1:]
    result = run(launch + command, {**environment, "ACCELERATE_USE_CPU": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "model.safetensors").exists()
    assert "padfree/padding_removed" in result.stdout and "balance/cost_max_over_mean" in result.stdout
    # 320 pairs, 8 per process: 2 steps are 0.1 epoch with two processes (0.05 with one)
    assert "'train_loss'" in result.stdout and "'epoch': '0.1'}" in result.stdout


def test_trl_script_with_swapped_import_trains_padding_free(tmp_path, environment):
    script = tmp_path / "dpo_swapped.py"
    swap = run([sys.executable, str(ROOT / "recipes" / "trl_script_swap_in.py"), str(script)], environment)
    assert swap.returncode == 0, swap.stderr
    changed = [line for line in swap.stdout.splitlines() if line.startswith(("+", "-")) and line[:3] not in "+++---"]
    assert changed == [
        "+    from trl_padfree import DPOTrainer  # swap-in: padding-free DPO",
        "+    from trl_padfree import DPOConfig  # swap-in: padding-free DPO",
    ]
    # TRL's script loads datasets by name: a folder with train/test files is one
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text((DATA_DIR / f"preferences_{split}.jsonl").read_text())
    environment = {**environment, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(script), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")]
    command += ["--model_name_or_path", _tiny_model_path(environment), "--padding_free", "true"]
    command += "--max_steps 2 --logging_steps 1 --use_cpu true --bf16 false --report_to none".split()
    result = run(command, environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "padfree/padding_removed" in result.stdout  # the swapped trainer ran, packed


def _tiny_model_path(environment: dict) -> str:
    code = "from trl_padfree.sources import resolve_model; print(resolve_model('trl-padfree/tiny-llama'))"
    return run([sys.executable, "-c", code], environment).stdout.strip()


def run_recipe_in_process(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """Exit status and stderr of `python recipes/dpo.py ARGS`, run in this process (a fresh one costs seconds)."""
    monkeypatch.setattr(sys, "argv", [str(RECIPE), *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(RECIPE), run_name="__main__")
    return exit_info.value.code, capsys.readouterr().err


def test_unknown_config_key_is_one_line_error(tmp_path, monkeypatch, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(TINY_CONFIG.read_text() + "\nlearning_rat: 1.0e-5\n")
    args = ["--config", str(config), "--output_dir", str(tmp_path)]
    assert_one_line_error(*run_recipe_in_process(args, monkeypatch, capsys), "learning_rat")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--dataset_name", "/no/such/pairs.jsonl"], "/no/such/pairs.jsonl"),
        (["--dataset_name", "./no_such_folder"], "no_such_folder"),
        (["--model_name_or_path", "trl-padfree/huge-llama"], "huge-llama"),
        (["--model_name_or_path", "/no/such/model"], "Model folder '/no/such/model' does not exist"),
        (["--dataset_train_split", "validation"], "validation"),
        (["--learning_rate", "fast"], "--learning_rate"),
    ],
)
def test_bad_recipe_input_is_one_line_error(args, expected, tmp_path, monkeypatch, capsys, environment):
    for name in ("TRL_PADFREE_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, environment[name])
    recipe_args = recipe(*args, output_dir=tmp_path)[2:]
    assert_one_line_error(*run_recipe_in_process(recipe_args, monkeypatch, capsys), expected)
