"""`trl-padfree dpo`: a shipped config trains from the installed package (a wheel built from the sources, unpacked
into a folder of its own, run from another folder), in one process and under `accelerate launch` with two CPU
processes; `--help` lists our options with our help and the command's defaults, rendered once per set of versions and
then printed from the user's cache without importing TRL; the command trains padding-free unless told otherwise and
says so; every argument of TRL's script is honoured (`dataset_streaming`, `ignore_bias_buffers` among them); dataset
mixtures from a YAML's `datasets:`; `push_to_hub` reaches the trainer (no network: the Hub calls are recorded)."""

import ast
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
import torch
import trl
import yaml
from datasets import IterableDataset
from distributed_runs import free_port
from one_line_errors import assert_one_line_error

from trl_padfree import DPOConfig, DPOTrainer
from trl_padfree.cli import dpo, help_cache, main
from trl_padfree.cli.launch import shipped_configs
from trl_padfree.data import DATA_DIR

ROOT = Path(__file__).resolve().parents[3]
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


@pytest.fixture
def help_folder(tmp_path, monkeypatch) -> Path:
    """A cache of the help's text of its own: a test's --help never reads or writes the user's."""
    monkeypatch.setenv("TRL_PADFREE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "help"


def test_help_lists_our_options_with_their_help(help_folder, capsys):
    assert main(["dpo", "--help"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    trl_fields = {field.name: field for field in dataclasses.fields(trl.DPOConfig)}
    ours = [field for field in dataclasses.fields(DPOConfig) if field.name not in trl_fields]
    # TRL's fields whose help is ours: what they do here differs from what TRL's help says
    changed = [field for field in dataclasses.fields(DPOConfig) if field.metadata != trl_fields.get(field.name, field).metadata]  # fmt: skip
    assert ours and {field.name for field in changed} == {"padding_free", "pad_to_multiple_of", "train_sampling_strategy"}  # fmt: skip
    for field in ours + changed:
        help_text = " ".join(field.metadata["help"].split())
        assert f"--{field.name}" in printed and help_text[:60] in printed, field.name
    for option in ("--dataset_name", "--model_name_or_path", "--use_peft", "--datasets", "--push_to_hub"):
        assert option in printed  # TRL's ScriptArguments, ModelConfig, DatasetMixtureConfig and TrainingArguments
    assert "Temporarily unavailable" not in printed  # TRL's own help for padding_free
    padding_free_help = printed[printed.index("--padding_free [PADDING_FREE], --padding-free") :]
    assert "(default: True)" in padding_free_help[: padding_free_help.index("--pad_to_multiple_of")]


HELP_AND_MODULES = (
    "import json, sys, trl_padfree; from trl_padfree.cli import main; status = main(['dpo', '--help']); "
    "print(json.dumps([status, sorted(sys.modules), trl_padfree.__file__]), file=sys.stderr)"
)


def test_help_is_rendered_once_then_printed_from_the_cache_without_importing_trl(installed, help_folder, tmp_path):
    # The first --help imports TRL's and transformers' configs (seconds) to render the text and caches it; the second
    # prints the same bytes and imports neither. From the wheel: a user's install, whose sources no one edits meanwhile
    environment = {**os.environ, "PYTHONPATH": str(installed)}
    first, second = [
        subprocess.run(
            [sys.executable, "-c", HELP_AND_MODULES], capture_output=True, env=environment, cwd=tmp_path, timeout=300
        )
        for _ in range(2)
    ]
    (first_status, first_modules, package), (second_status, modules, _) = (
        json.loads(run.stderr.decode().strip().splitlines()[-1]) for run in (first, second)
    )
    assert package == str(installed / "trl_padfree" / "__init__.py")
    assert first_status == second_status == 0 and "--padding_free" in first.stdout.decode()
    assert second.stdout == first.stdout and len(list(help_folder.glob("dpo-*.txt"))) == 1
    heavy = ("trl", "transformers", "torch")
    imported = [module for module in modules if module.split(".")[0] in heavy]
    assert set(heavy) <= set(first_modules) and not imported, imported


@pytest.mark.parametrize("entry", ["python", "trl_padfree", "trl", "transformers", "accelerate", "peft", "torch"])
def test_another_version_or_source_misses_the_cache(help_folder, monkeypatch, capsys, entry):
    # The text is read back only for the key it was rendered for: any one entry changed renders it again
    installed = dpo.help_key()
    changed = {**installed, entry: installed[entry] + "+changed"}
    renders = []
    for key in (installed, installed, changed, changed):
        monkeypatch.setattr(dpo, "help_key", lambda key=key: key)
        monkeypatch.setattr(dpo, "render_help", lambda key=key: renders.append(key) or f"help for {key}\n")
        assert main(["dpo", "--help"]) == 0
        assert capsys.readouterr().out == f"help for {key}\n"
    assert renders == [installed, changed] and len(list(help_folder.glob("dpo-*.txt"))) == 2


def test_the_cache_key_follows_the_packages_sources_and_file_names(tmp_path, monkeypatch):
    package = tmp_path / "trl_padfree"
    (package / "cli" / "configs").mkdir(parents=True)
    (package / "config.py").write_text("HELP = 'one'\n")
    (package / "cli" / "configs" / "tiny_cpu.yaml").write_text("max_steps: 1\n")
    monkeypatch.setattr(help_cache, "PACKAGE_ROOT", package)
    digests = [help_cache.sources_digest()]
    (package / "cli" / "configs" / "tiny_cpu.yaml").write_text("max_steps: 2\n")  # not in the help: same text
    digests.append(help_cache.sources_digest())
    (package / "config.py").write_text("HELP = 'two'\n")
    digests.append(help_cache.sources_digest())
    (package / "cli" / "configs" / "small_cpu.yaml").write_text("max_steps: 1\n")  # the epilog lists its name
    digests.append(help_cache.sources_digest())
    assert digests[0] == digests[1] and len(set(digests[1:])) == 3


def test_an_unwritable_cache_still_prints_the_help_and_says_why_it_is_slow(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a file where the cache folder should be: unwritable even for root
    monkeypatch.setenv("TRL_PADFREE_CACHE", str(blocker))
    assert main(["dpo", "--help"]) == 0
    printed = capsys.readouterr()
    assert printed.out == dpo.render_help() and "--padding_free" in printed.out
    assert "could not be cached" in printed.err and "Set TRL_PADFREE_CACHE to a writable folder" in printed.err


def test_the_cache_folder_follows_xdg_and_its_own_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("TRL_PADFREE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert help_cache.cache_folder() == Path.home() / ".cache" / "trl_padfree"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert help_cache.cache_folder() == tmp_path / "xdg" / "trl_padfree"
    monkeypatch.setenv("TRL_PADFREE_CACHE", str(tmp_path / "ours"))
    assert help_cache.cache_folder() == tmp_path / "ours"


@pytest.mark.parametrize(
    "recipe, arguments, padding_free",
    [({}, [], True), ({}, ["--padding_free", "false"], False), ({"padding_free": False}, [], False)],
    ids=["the command's default", "the command line", "the config"],
)
def test_the_command_trains_padding_free_unless_told_otherwise(tmp_path, recipe, arguments, padding_free):
    # TRL's default (False) is a script's; the command packs unless its config or command line says otherwise
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"dataset_name": "trl-padfree/demo-preferences", "use_cpu": True, **recipe}))
    _, training_args, *_ = dpo.parse_script_arguments(["--config", str(path), *arguments])
    assert training_args.padding_free is padding_free
    assert DPOConfig(output_dir=str(tmp_path), use_cpu=True).padding_free is False


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


def trained(monkeypatch) -> list[DPOTrainer]:
    """The trainers the script builds, each recorded at `train()` instead of training."""
    trainers = []
    monkeypatch.setattr(DPOTrainer, "train", lambda self, **kwargs: trainers.append(self))
    return trainers


def test_the_run_says_first_which_mode_trains(in_process, tmp_path, monkeypatch, capsys):
    trained(monkeypatch)
    train_in_process({}, tmp_path)
    printed = capsys.readouterr().out
    assert printed.startswith(dpo.training_mode(True)) and printed.count("trl-padfree dpo: ") == 1
    train_in_process({"padding_free": False, "prefix_sharing": False}, tmp_path)
    assert capsys.readouterr().out.startswith("trl-padfree dpo: padded training on TRL's batches (padding_free=False")


def test_dataset_streaming_trains_on_a_stream(in_process, tmp_path):
    # As TRL's script: the dataset is loaded streaming (an IterableDataset, read as training goes), max_steps set
    original_init = DPOTrainer.__init__
    datasets_trained = []

    def init(self, *args, **kwargs):
        datasets_trained.append(kwargs["train_dataset"])
        original_init(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DPOTrainer, "__init__", init)
        train_in_process({}, tmp_path, "--dataset_streaming", "true")
    assert isinstance(datasets_trained[0], IterableDataset)
    assert (tmp_path / "model" / "model.safetensors").exists()


def test_ignore_bias_buffers_leaves_the_models_boolean_buffers_to_ddp(in_process, tmp_path, monkeypatch):
    trainers = trained(monkeypatch)
    train_in_process({}, tmp_path)
    train_in_process({}, tmp_path, "--ignore_bias_buffers", "true")
    without, with_flag = trainers
    assert not hasattr(without.model, "_ddp_params_and_buffers_to_ignore")
    boolean = [name for name, buffer in with_flag.model.named_buffers() if buffer.dtype == torch.bool]
    assert with_flag.model._ddp_params_and_buffers_to_ignore == boolean


def test_ddp_leaves_the_boolean_buffers_it_is_told_to(monkeypatch):
    # What TRL's script relies on: DistributedDataParallel reads the list when it wraps the model
    from trl_padfree.integrations.trl import ignore_boolean_buffers_in_ddp

    model = torch.nn.Linear(2, 2)
    model.register_buffer("causal_mask", torch.ones(3, 3, dtype=torch.bool))
    model.register_buffer("scale", torch.ones(1))
    ignore_boolean_buffers_in_ddp(model)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        assert torch.nn.parallel.DistributedDataParallel(model).parameters_to_ignore == {"causal_mask"}
    finally:
        torch.distributed.destroy_process_group()


def test_every_argument_of_trls_script_is_honoured():
    """Each field of TRL's `ScriptArguments` and `ModelConfig` is read by the script (`main`) or by the TRL helpers
    it hands `model_args` to, as in TRL's script; a field TRL adds fails here until it is honoured or refused."""
    from trl import ModelConfig, ScriptArguments, get_peft_config, get_quantization_config

    read = {"script_args": set(), "model_args": set()}
    for node in ast.walk(ast.parse(Path(dpo.__file__).read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in read:
            read[node.value.id].add(node.attr)

    class Recording:  # the fields a TRL helper reads
        def __init__(self, arguments):
            self.arguments = arguments

        def __getattr__(self, name):
            read["model_args"].add(name)
            return getattr(self.arguments, name)

    for options in ({"use_peft": True}, {"load_in_4bit": True}, {"load_in_8bit": True}):
        model_args = Recording(ModelConfig(**options))
        get_peft_config(model_args)
        get_quantization_config(model_args)
    for name, arguments_class in (("script_args", ScriptArguments), ("model_args", ModelConfig)):
        unread = [field.name for field in dataclasses.fields(arguments_class) if field.name not in read[name]]
        assert not unread, f"{arguments_class.__name__} fields neither honoured nor refused by the script: {unread}"


def test_push_to_hub_reaches_the_trainer(in_process, tmp_path, monkeypatch):
    pushes = []

    def init_hf_repo(self, token=None):  # the repository Trainer would create at construction
        self.hub_model_id = self.args.hub_model_id

    monkeypatch.setattr(DPOTrainer, "init_hf_repo", init_hf_repo)
    monkeypatch.setattr(DPOTrainer, "push_to_hub", lambda self, **kwargs: pushes.append(kwargs))
    train_in_process({}, tmp_path, "--push_to_hub", "true", "--hub_model_id", "someone/tiny-padfree")
    # the script's push names the dataset on the model card, as TRL's does (save_model pushes once before it)
    assert pushes[-1] == {"dataset_name": "trl-padfree/demo-preferences"}
