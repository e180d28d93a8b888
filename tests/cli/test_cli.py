"""`trl-padfree` command line: the demo's report, one-line errors for bad input, help for every option."""

import argparse
import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from one_line_errors import assert_one_line_error

from trl_padfree.cli import READS_ITS_OWN_ARGUMENTS, SUBCOMMANDS, build_parser, main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trl_padfree.cli", *args], capture_output=True, text=True, timeout=300
    )


def exit_status(call) -> int:
    with pytest.raises(SystemExit) as exit_info:
        call()
    return exit_info.value.code


def test_console_script_is_installed():
    scripts = {entry.name: entry.value for entry in entry_points(group="console_scripts")}
    assert scripts.get("trl-padfree") == "trl_padfree.cli:main"


def test_demo_trains_both_modes_to_equal_losses(tmp_path, capsys):
    report_path = tmp_path / "report.json"
    args = ["demo", "--size", "tiny", "--steps", "3", "--batch-size", "4", "--report", str(report_path)]
    assert main(args) == 0
    report = json.loads(report_path.read_text())
    assert report["steps"] == 3 and report["pairs_per_step"] == 4
    assert report["padfree_final_loss"] == pytest.approx(report["padded_final_loss"], abs=1e-5)
    assert report["max_loss_diff"] < 1e-5
    assert 0 < report["padding_removed"] < 1
    assert report["real_tokens"] < report["padded_tokens"]
    assert report["ideal_speedup"] == pytest.approx(report["padded_tokens"] / report["real_tokens"])
    assert report["padded_tokens_per_s"] > 0 and report["padfree_tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert "padding removed" in printed and "speedup" in printed


def test_demo_with_prefix_sharing_trains_to_padded_losses(tmp_path, capsys):
    report_path = tmp_path / "report.json"
    args = ["demo", "--size", "tiny", "--steps", "2", "--batch-size", "4", "--prefix-sharing"]
    assert main([*args, "--report", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["prefix_sharing"] and 0 < report["shared_tokens"] < report["real_tokens"]
    assert report["max_loss_diff"] < 1e-5
    assert report["ideal_speedup"] == pytest.approx(
        report["padded_tokens"] / (report["real_tokens"] - report["shared_tokens"])
    )
    assert "prompt tokens shared" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, expected",
    [
        (["demo", "--size", "huge"], "--size"),
        (["demo", "--model-type", "opt"], "--model-type"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--attn-implementation", "flex_attention"], "--attn-implementation"),
        (["launch-rockets"], "launch-rockets"),
    ],
)
def test_bad_command_line_is_one_line_error(args, expected, capsys):
    assert_one_line_error(exit_status(lambda: main(args)), capsys.readouterr().err, expected)


def test_demo_too_short_max_length_is_one_line_error():
    # In a fresh process, as a user runs it. Every shipped prompt is longer than one token: nothing is left to train
    result = run_cli("demo", "--size", "tiny", "--steps", "1", "--max-length", "1")
    assert_one_line_error(result.returncode, result.stderr, "no examples left")


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_option_of_every_subcommand_has_help(command):
    if command in READS_ITS_OWN_ARGUMENTS:  # `dpo`: TRL's dataclasses and ours, through TRL's parser
        from trl_padfree.cli.dpo import make_parser

        parser = make_parser()
    else:
        commands = next(action for action in build_parser(command)._actions if action.dest == "command")
        parser = commands.choices[command]
    actions = [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]
    assert actions and all(action.help for action in actions), [
        action.option_strings or action.dest for action in actions if not action.help
    ]


# ---- trl-padfree configs ----


def shipped_names(kind: str) -> list[str]:
    from trl_padfree.cli.launch import shipped_configs

    return list(shipped_configs(kind))


def test_configs_lists_every_shipped_config_with_its_first_sentence(capsys):
    from trl_padfree.cli.configs_command import description, shipped_config

    assert main(["configs"]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # as one line: descriptions wrap to the terminal
    names = shipped_names("configs") + shipped_names("accelerate_configs")
    assert len(names) == len(set(names)), "a DPO config and an accelerate config share a name: show is ambiguous"
    for name in names:
        assert f"{name} {description(shipped_config(name))}" in printed
    assert description(shipped_config("zero2")).startswith("DeepSpeed ZeRO-2: optimizer states and gradients")
    assert description(shipped_config("tiny_cpu")).endswith("CPU only.")


def test_configs_show_prints_the_shipped_file(capsys):
    from trl_padfree.cli.launch import shipped_configs

    for kind, name in [("configs", "tiny_cpu"), ("accelerate_configs", "zero3_sp2")]:
        assert main(["configs", "show", name]) == 0
        assert capsys.readouterr().out == shipped_configs(kind)[name].read_text()


def test_configs_copy_gives_a_file_accelerate_launches_with(tmp_path, monkeypatch, capsys):
    from accelerate.commands.config.config_args import load_config_from_file

    from trl_padfree.cli.launch import shipped_configs

    monkeypatch.chdir(tmp_path)
    assert main(["configs", "copy", "fsdp2"]) == 0  # into the working directory
    assert main(["configs", "copy", "zero3.yaml", "my_zero3.yaml"]) == 0  # to a file, the suffix given or not
    (tmp_path / "recipes").mkdir()
    assert main(["configs", "copy", "tiny_cpu", "recipes"]) == 0  # into a folder
    assert "Copied tiny_cpu.yaml to recipes/tiny_cpu.yaml" in capsys.readouterr().out
    assert (tmp_path / "recipes" / "tiny_cpu.yaml").read_text() == shipped_configs("configs")["tiny_cpu"].read_text()
    assert load_config_from_file("fsdp2.yaml").fsdp_config["fsdp_version"] == 2
    assert load_config_from_file("my_zero3.yaml").deepspeed_config["zero_stage"] == 3


@pytest.mark.parametrize(
    "args, expected",
    [
        (["configs", "show", "zero4"], "No shipped config named 'zero4'. Shipped: "),
        (["configs", "copy", "zero3", "taken.yaml"], "taken.yaml exists"),
        (["configs", "show"], "name"),
        (["configs", "print", "zero3"], "print"),
    ],
)
def test_configs_bad_input_is_one_line_error(args, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken.yaml").write_text("mine")
    assert_one_line_error(exit_status(lambda: main(args)), capsys.readouterr().err, expected)
    assert (tmp_path / "taken.yaml").read_text() == "mine"


def test_configs_imports_neither_torch_nor_trl():
    code = (
        "import json, sys; from trl_padfree.cli import main; status = main(['configs']); "
        "print(json.dumps([status, sorted(sys.modules)]), file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    status, modules = json.loads(result.stderr.strip().splitlines()[-1])
    assert status == 0 and "zero3_sp2" in result.stdout
    assert not [module for module in ("torch", "trl", "transformers") if module in modules]


# ---- a model argument: `models --check` and `plan` read it the same way ----


@pytest.mark.parametrize("command", [["models", "--check"], ["plan"]], ids=["models --check", "plan"])
@pytest.mark.parametrize(
    "model, why",
    [("./no-such-folder", "there is no such folder or file."), ("empty", "the folder holds no config.json.")],
    ids=["no such folder", "a folder without config.json"],
)
def test_a_model_that_is_no_folder_or_config_is_one_line(command, model, why, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    takes = "parameter count, model folder or config.json" if command == ["plan"] else "model folder or config.json"
    status = exit_status(lambda: main([*command, model]))
    assert_one_line_error(status, capsys.readouterr().err, f"error: {model!r} is no {takes}: {why}")
