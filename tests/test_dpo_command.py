"""`trl-padfree dpo`: a shipped config trains from the installed package (a wheel built from the sources, unpacked
into a folder of its own, run from another folder), in one process and under `accelerate launch` with two CPU
processes; `--help` lists our options; dataset mixtures from a YAML's `datasets:`; `push_to_hub` reaches the trainer
(no network: the Hub calls are recorded)."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import trl
import yaml
from distributed_runs import free_port
from test_cli import assert_one_line_error

from trl_padfree import DPOConfig, DPOTrainer
from trl_padfree.cli import dpo, main
from trl_padfree.cli.launch import shipped_configs
from trl_padfree.data import DATA_DIR

ROOT = Path(__file__).resolve().parent.parent
# The tiny config, made a few seconds long: the smallest model, two steps
QUICK = ["--model_name_or_path", "trl-padfree/tiny-llama", "--max_steps", "2", "--logging_steps", "1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # the demo model, built once for every run here


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package as a user installs it: a wheel built from a copy of the sources, unpacked."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    shutil.copytree(ROOT / "trl_padfree", source / "trl_padfree", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path_factory.mktemp("wheels")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    subprocess.run([*build, str(source)], check=True, capture_output=True, timeout=300)
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(next(wheels.glob("trl_padfree-*.whl"))) as wheel:
        wheel.extractall(site)
    return site


def run_installed(arguments: list[str], site: Path, cache: Path, cwd: Path, **environment: str):
    """`trl-padfree ARGUMENTS` with the unpacked wheel first on the path, from `cwd`; prints where the package is."""
    code = "import sys, trl_padfree; print('PACKAGE', trl_padfree.__file__); from trl_padfree.cli import main; "
    code += "sys.exit(main())"
    environment = {
        **os.environ, "PYTHONPATH": str(site), "TRL_PADFREE_CACHE": str(cache), "TQDM_DISABLE": "1",
        "HF_HUB_OFFLINE": "1", **environment,
    }  # fmt: skip
    command = [sys.executable, "-c", code, *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=environment, cwd=cwd, timeout=600)


def test_the_wheel_ships_every_config(installed):
    for kind in ("configs", "accelerate_configs"):
        shipped = sorted(path.name for path in (installed / "trl_padfree" / "cli" / kind).glob("*.yaml"))
        assert shipped == sorted(f"{name}.yaml" for name in shipped_configs(kind))


def test_a_shipped_config_trains_from_the_installed_package(installed, cache, tmp_path):
    output_dir = tmp_path / "model"
    arguments = ["dpo", "--config", "tiny_cpu", *QUICK, "--eval_strategy", "steps", "--eval_steps", "2"]
    result = run_installed([*arguments, "--output_dir", str(output_dir)], installed, cache, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"PACKAGE {installed / 'trl_padfree' / '__init__.py'}" in result.stdout
    assert (output_dir / "model.safetensors").exists() and (output_dir / "tokenizer.json").exists()
    assert "padfree/padding_removed" in result.stdout and "eval_padfree/padding_removed" in result.stdout


@pytest.mark.slow  # ~30 s on 2 cores, beside ~25 s for the one-process run: two processes to start and join
def test_two_cpu_processes_through_the_shipped_accelerate_config(installed, cache, tmp_path):
    # Data parallelism over gloo: the multi-GPU config on CPU processes, balanced as the multi-GPU recipes run
    output_dir = tmp_path / "model"
    arguments = ["dpo", "--config", "tiny_cpu", "--accelerate_config", "multi_gpu", "--num_processes", "2"]
    arguments += ["--mixed_precision", "no", "--main_process_port", str(free_port()), *QUICK]
    arguments += ["--train_sampling_strategy", "batch_rebalance", "--eval_strategy", "no"]
    result = run_installed(
        [*arguments, "--output_dir", str(output_dir)], installed, cache, cwd=tmp_path, ACCELERATE_USE_CPU="true"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (output_dir / "model.safetensors").exists()
    assert "padfree/padding_removed" in result.stdout and re.search(r"balance[/_]cost_max_over_mean", result.stdout)
    # 8 pairs per process: 2 steps take 32 of the ~320 pairs with two processes (16 with one)
    assert re.search(r"'epoch': '0\.1\d*'}", result.stdout), result.stdout[-2000:]


def test_a_bad_launch_option_is_one_line(capsys):
    for arguments, expected in [
        (["--accelerate_config", "zero4"], "--accelerate_config zero4: no such file, and no shipped config"),
        (["--num_procesess", "2"], "unrecognized arguments: --num_procesess"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["dpo", "--config", "tiny_cpu", *arguments])
        assert_one_line_error(exit_info.value.code, capsys.readouterr().err, expected)


# ---------------------------------------------------------------------------------------------------------------------
# In this process: --help, and the training script's main() on what the parser makes of a YAML


def test_help_lists_our_options_with_their_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["dpo", "--help"])
    assert exit_info.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())
    ours = [field for field in dataclasses.fields(DPOConfig) if field.name not in trl.DPOConfig.__dataclass_fields__]
    assert ours, "DPOConfig adds no field"
    for field in ours:
        help_text = " ".join(field.metadata["help"].split())
        assert f"--{field.name}" in printed and help_text[:60] in printed, field.name
    for option in ("--dataset_name", "--model_name_or_path", "--use_peft", "--datasets", "--push_to_hub"):
        assert option in printed  # TRL's ScriptArguments, ModelConfig, DatasetMixtureConfig and TrainingArguments


@pytest.fixture
def in_process(cache, monkeypatch):
    monkeypatch.setenv("TRL_PADFREE_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def train_in_process(config: dict, tmp_path: Path, *arguments: str) -> None:
    recipe = yaml.safe_load(shipped_configs("configs")["tiny_cpu"].read_text()) | config
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    arguments = ["--config", str(path), *QUICK, "--max_steps", "1", "--eval_strategy", "no", *arguments]
    dpo.main(*dpo.parse_script_arguments([*arguments, "--output_dir", str(tmp_path / "model")]))


def test_a_dataset_mixture_reaches_the_trainer(in_process, tmp_path, monkeypatch):
    train = [json.loads(line) for line in (DATA_DIR / "preferences_train.jsonl").read_text().splitlines()]
    # TRL drops pairs whose prompt fills max_length (1024 tokens here): prompts of fewer characters all stay
    train = [row for row in train if len(json.dumps(row["prompt"])) < 1000]
    parts = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
    for part, rows in zip(parts, (train[:24], train[24:40]), strict=True):
        part.write_text("".join(json.dumps(row) + "\n" for row in rows))
    datasets = [{"path": "json", "data_files": str(part), "split": "train"} for part in parts]
    trained_on = []
    original_train = DPOTrainer.train

    def train(self, *args, **kwargs):
        trained_on.append(self.train_dataset)
        return original_train(self, *args, **kwargs)

    monkeypatch.setattr(DPOTrainer, "train", train)
    # `datasets` wins over the config's dataset_name, as in TRL's script
    train_in_process({"datasets": datasets}, tmp_path)
    assert len(trained_on[0]) == 40
    assert (tmp_path / "model" / "model.safetensors").exists()


def test_push_to_hub_reaches_the_trainer(in_process, tmp_path, monkeypatch):
    pushes = []

    def init_hf_repo(self, token=None):  # the repository Trainer would create at construction
        self.hub_model_id = self.args.hub_model_id

    monkeypatch.setattr(DPOTrainer, "init_hf_repo", init_hf_repo)
    monkeypatch.setattr(DPOTrainer, "push_to_hub", lambda self, **kwargs: pushes.append(kwargs))
    train_in_process({}, tmp_path, "--push_to_hub", "true", "--hub_model_id", "someone/tiny-padfree")
    # the script's push names the dataset on the model card, as TRL's does (save_model pushes once before it)
    assert pushes[-1] == {"dataset_name": "trl-padfree/demo-preferences"}
