"""`trl-padfree dpo`'s own lines, run as a user runs it (a fresh process, accelerate launching the training process):
the first line names the mode and where `padding_free` came from, before accelerate's warnings; a shipped config that
evaluates turns its evaluation off, saying so, on a data file with no test split; evaluation asked for by the user on
such data stops with the way out."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trl_padfree.cli import dpo
from trl_padfree.cli.launch import Origin, resolve_config_arguments, setting_origins, shipped_configs
from trl_padfree.sources import load_preference_dataset

# The smallest model, one step, every checkpoint and report off: the lines are what is tested
QUICK = ["--model_name_or_path", "trl-padfree/tiny-llama", "--max_steps", "1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # the demo model, built once for every run here


@pytest.fixture
def pairs(tmp_path) -> Path:
    """A user's data file: prompt/chosen/rejected rows, one JSON object a line (loads as a `train` split only)."""
    path = tmp_path / "good.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."} for i in range(9)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_dpo(arguments: list[str], cache: Path, cwd: Path) -> tuple[int, list[str]]:
    """`trl-padfree dpo ARGUMENTS` in a fresh process; its exit status and its lines, stdout and stderr in the order
    they were written."""
    environment = {**os.environ, "TRL_PADFREE_CACHE": str(cache), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    environment.pop(dpo.FIRST_LINE_PRINTED, None)
    command = [sys.executable, "-m", "trl_padfree.cli", "dpo", *arguments, "--output_dir", str(cwd / "model")]
    result = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment, cwd=cwd, timeout=600
    )
    return result.returncode, [line for line in result.stdout.splitlines() if line.strip()]


def test_a_shipped_config_on_a_data_file_trains_without_evaluation_and_says_so(pairs, cache, tmp_path):
    status, lines = run_dpo(["--config", "tiny_cpu", "--dataset_name", str(pairs), *QUICK], cache, tmp_path)
    assert status == 0, "\n".join(lines[-30:])
    # First, before accelerate's launcher warns about the defaults it picks; the config sets padding_free itself
    assert lines[0] == (
        "trl-padfree dpo: padding-free training (padding_free=True, set in the config tiny_cpu): each batch's pairs "
        "are packed into one row. --padding_free false trains on TRL's padded batches."
    )
    assert [line for line in lines if line.startswith("trl-padfree dpo: ")][1:] == [
        f"trl-padfree dpo: evaluation off: {pairs} has no split 'test' (it has ['train']), which the config tiny_cpu "
        "evaluates on (eval_strategy: steps). To evaluate, name one of its splits with --dataset_test_split, or give a "
        "folder holding train.jsonl and test.jsonl; --eval_strategy no turns it off without this line."
    ]
    assert not [line for line in lines if "eval_loss" in line]  # trained, never evaluated
    assert (tmp_path / "model" / "model.safetensors").exists()


def test_a_folder_of_train_and_test_files_gives_both_splits(pairs, tmp_path):
    # The way back to evaluation the line gives
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(pairs.read_text())
    assert sorted(load_preference_dataset(str(folder))) == ["test", "train"]


def test_evaluation_the_user_asks_for_on_data_without_a_test_split_stops_with_the_way_out(pairs, cache, tmp_path):
    arguments = ["--config", "tiny_cpu", "--dataset_name", str(pairs), *QUICK, "--eval_strategy", "steps"]
    status, lines = run_dpo([*arguments, "--padding-free", "false", "--prefix_sharing", "false"], cache, tmp_path)
    assert status == 2
    assert lines[0] == (
        "trl-padfree dpo: padded training on TRL's batches (padding_free=False, set on the command line; the "
        "command's default is True)."
    )
    assert lines[-1] == (
        f"trl-padfree dpo: error: The dataset has no split 'test'; it has ['train'] ({pairs}). eval_strategy 'steps' "
        "(set on the command line) evaluates on it: name one of its splits with --dataset_test_split, or train without "
        "evaluation: --eval_strategy no."
    )


def test_a_users_own_config_that_evaluates_stops_with_the_way_out(pairs, cache, tmp_path):
    # Not a shipped config: the evaluation is the user's own, never turned off for them; padding_free left unset
    recipe = yaml.safe_load(shipped_configs("configs")["tiny_cpu"].read_text())
    del recipe["padding_free"]
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe))
    status, lines = run_dpo(["--config", str(recipe_path), "--dataset_name", str(pairs), *QUICK], cache, tmp_path)
    assert status == 2
    assert lines[0].startswith("trl-padfree dpo: padding-free training (padding_free=True, the command's default): ")
    assert lines[-1].startswith(
        f"trl-padfree dpo: error: The dataset has no split 'test'; it has ['train'] ({pairs})."
    )
    assert f"eval_strategy 'steps' (set in the config {recipe_path}) evaluates on it" in lines[-1]
    assert "--eval_strategy no" in lines[-1]


@pytest.mark.parametrize(
    "arguments, recipe, origin",
    [
        ([], {}, Origin()),
        (["--padding_free", "false"], {}, Origin(command_line=True)),
        (["--padding-free=false"], {"padding_free": True}, Origin(command_line=True, config="RECIPE")),
        (["--padding_free"], {}, Origin(command_line=True)),
        (["--num_processes", "2"], {"padding_free": False}, Origin(config="RECIPE")),
    ],
    ids=["a default", "the command line", "both, the dashed spelling", "a bare flag", "the config"],
)
def test_setting_origins_reads_every_spelling(arguments, recipe, origin, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"dataset_name": "trl-padfree/demo-preferences", **recipe}))
    argv = resolve_config_arguments(["--config", str(path), *arguments])
    found = setting_origins(dpo.make_parser(), argv, ["padding_free"])["padding_free"]
    assert found == Origin(origin.command_line, str(path) if origin.config else None)
    assert found.shipped_config is None


def test_a_shipped_config_is_named(tmp_path):
    argv = resolve_config_arguments(["--config", "tiny_cpu"])
    origins = setting_origins(dpo.make_parser(), argv, ["padding_free", "eval_strategy", "dataset_name"])
    assert [str(origins[name]) for name in ("padding_free", "eval_strategy")] == ["set in the config tiny_cpu"] * 2
    assert origins["dataset_name"].shipped_config == "tiny_cpu"


def test_the_guide_names_every_shipped_config_that_evaluates():
    guide = " ".join((Path(__file__).resolve().parents[3] / "docs/guides/coming-from-trl.md").read_text().split())
    sentence = re.search(r"((?:`[\w.-]+`(?:, | and ))*`[\w.-]+`) evaluate \(`eval_strategy: steps`\)", guide)
    evaluating = {
        name
        for name, path in shipped_configs("configs").items()
        if yaml.safe_load(path.read_text()).get("eval_strategy", "no") != "no"
    }
    assert sentence and set(re.findall(r"`([\w.-]+)`", sentence.group(1))) == evaluating
    assert "turns their evaluation off and says so in one line" in guide
