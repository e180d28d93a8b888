"""`trl-padfree` command line: the demo's report, one-line errors for bad input, help for every option."""

import argparse
import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from trl_padfree.cli import READS_ITS_OWN_ARGUMENTS, SUBCOMMANDS, build_parser, main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trl_padfree.cli", *args], capture_output=True, text=True, timeout=300
    )


def assert_one_line_error(returncode: int, stderr: str, *expected: str) -> None:
    assert returncode == 2, stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], stderr
    for text in expected:
        assert text in lines[0]


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
