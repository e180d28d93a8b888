"""Every benchmark file records what a user needs to reproduce it, and the writers record it from now on.

A file's "provenance" holds the command, trl-padfree's version and commit, the versions of torch, transformers and TRL
(and neighbours), the device, the date and the flags; a value the run did not record is written "unknown", never
guessed. A file today's command cannot reproduce says `"reproducible": false` and why; a reproducible file's command
must still run today: a `trl-padfree bench` or `trl-padfree balance` command parses with today's options, a
`python tools/...` script exists.
"""

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from trl_padfree.cli import balance
from trl_padfree.cli.bench.command import add_arguments
from trl_padfree.cli.bench.report import run_provenance, write_rows

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "docs" / "bench").glob("*.json"))
VERSIONED = ("torch", "transformers", "trl")
FIELDS = ("command", "trl_padfree", "commit", "versions", "device", "date", "flags", "reproducible")


def check_provenance(provenance: dict) -> None:
    missing = [field for field in FIELDS if field not in provenance]
    assert not missing, f"no {missing}"
    for field in ("command", "trl_padfree", "commit", "device"):
        assert isinstance(provenance[field], str) and provenance[field].strip(), field
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", provenance["date"])
    assert all(provenance["versions"].get(package) for package in VERSIONED), provenance["versions"]
    assert isinstance(provenance["flags"], dict)
    if provenance["reproducible"] is False:
        assert provenance.get("why"), "a file marked not reproducible says why"
    else:
        assert provenance["reproducible"] is True
        runs_today(provenance["command"])


def runs_today(command: str) -> None:
    words = shlex.split(command)
    subcommands = {"bench": add_arguments, "balance": balance.add_arguments}
    if words[0] == "trl-padfree" and words[1] in subcommands:
        parser = argparse.ArgumentParser(exit_on_error=False)
        subcommands[words[1]](parser)
        options = parser.parse_args(words[2:])
        if words[1] == "balance":
            balance.check_options(options)
    else:
        assert words[0] == "python" and (ROOT / words[1]).is_file(), f"{command!r}: no such script today"


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.name)
def test_each_bench_file_records_its_provenance(path):
    check_provenance(json.loads(path.read_text())["provenance"])


def test_the_gpu_run_whose_harness_is_gone_is_marked():
    provenance = json.loads((ROOT / "docs" / "bench" / "gpu_qwen0.5b.json").read_text())["provenance"]
    assert provenance["reproducible"] is False and "emptied the CUDA cache" in provenance["why"]


@dataclass
class Row:
    speedup: float


def test_the_writer_records_provenance(tmp_path):
    output = tmp_path / "rows.json"
    write_rows([Row(1.5)], str(output), {"model": "tiny", "batches": 2})
    written = json.loads(output.read_text())
    assert written["rows"] == [{"speedup": 1.5}]
    assert written["provenance"]["flags"] == {"batches": 2, "model": "tiny"}
    check_provenance(written["provenance"] | {"command": "trl-padfree bench --model tiny --batches 2"})


def test_a_file_without_provenance_is_refused():
    with pytest.raises(AssertionError, match="no"):
        check_provenance({key: value for key, value in run_provenance({}).items() if key != "date"})
