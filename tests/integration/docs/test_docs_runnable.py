"""Every code block of the README and the quickstart runs as written, on CPU, offline.

How each fenced block runs:
- `python`: in a fresh interpreter; a block of `>>>` examples through doctest, its printed output checked;
- `diff`: the script after the change (the `+` and unchanged lines), as a `python` block;
- `bash`: each `trl-padfree ...` command, with its environment assignments; `pip install` lines are skipped (the
  suite runs where the package is installed), and any other command fails this test until it is given a rule;
- `text`: printed output, not run.

A block that needs a GPU or the hub says so beside it and names its CPU twin in the comment on the line above its
fence, `<!-- cpu-twin: COMMAND -->`: the test runs the twin instead. `<!-- continues the block above -->` runs a
python block after the one above it, in the same interpreter. A block that trains (the demo, `trl-padfree dpo`,
`trainer.train()`) is `slow`.
"""

import doctest
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", ROOT / "docs" / "guides" / "quickstart.md"]
FENCE = re.compile(r"(?:^<!-- (?P<note>[^>]*) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S)
TRAINS = re.compile(r"trl-padfree (?:demo|dpo)\b|\.train\(\)")
TIMEOUT_S = 1800


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    note: str  # the HTML comment on the line above the fence, if any

    @property
    def twin(self) -> str | None:
        return self.note.removeprefix("cpu-twin:").strip() if self.note.startswith("cpu-twin:") else None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [
        Block(
            str(page.relative_to(ROOT)),
            text.count("\n", 0, match.start("code")),
            match["lang"],
            match["code"],
            match["note"] or "",
        )
        for match in FENCE.finditer(text)
    ]


ALL = [block for page in PAGES for block in blocks(page)]


def python_source(block: Block, before: Block | None) -> str:
    """The block as a script: a diff's side after the change, `>>>` examples as statements, after the block above."""
    if block.lang == "diff":
        return "".join(line[1:] + "\n" for line in block.code.splitlines() if not line.startswith("-"))
    source = doctest.script_from_examples(block.code) if block.code.lstrip().startswith(">>>") else block.code
    if block.note == "continues the block above":
        return python_source(before, None) + "\n" + source
    return source


def commands(block: Block) -> list[str]:
    """The `trl-padfree` commands a bash block runs (its twin's where it names one), continuation lines joined."""
    if block.twin:
        return [block.twin]
    found = []
    for line in block.code.replace("\\\n", " ").splitlines():
        command = line.split(" #", 1)[0].strip()
        if not command or command.startswith("pip install"):
            continue
        assert re.match(r"^(?:\w+=\S+ )*trl-padfree ", command), f"{block.name}: no rule runs {command!r}"
        found.append(command)
    return found


def environment(tmp_path: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this venv's trl-padfree
    env["TRL_PADFREE_CACHE"] = str(tmp_path / "cache")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run(argv: list[str] | str, tmp_path: Path, **kwargs) -> subprocess.CompletedProcess:
    found = subprocess.run(
        argv, cwd=tmp_path, env=environment(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs
    )
    assert found.returncode == 0, f"{argv}\n{found.stdout[-3000:]}\n{found.stderr[-3000:]}"
    return found


def case(block: Block, index: int):
    marks = [pytest.mark.slow] if TRAINS.search(block.twin or block.code) else []
    return pytest.param(block, ALL[index - 1] if index else None, id=block.name, marks=marks)


RUNNABLE = [case(block, index) for index, block in enumerate(ALL) if block.lang in ("python", "diff", "bash")]


def test_every_block_has_a_way_to_run():
    assert {block.lang for block in ALL} <= {"python", "diff", "bash", "text"}, {block.lang for block in ALL}
    assert len(RUNNABLE) >= 10
    twins = [block for block in ALL if block.note]
    assert all(block.twin or block.note == "continues the block above" for block in twins), [b.note for b in twins]
    for block in ALL:
        if block.lang == "bash":
            commands(block)  # a command no rule runs fails here


@pytest.mark.parametrize("block, before", RUNNABLE)
def test_the_block_runs_as_written(block, before, tmp_path):
    if block.lang == "bash":
        for command in commands(block):
            run(["bash", "-c", command], tmp_path)
        return
    if block.code.lstrip().startswith(">>>"):  # printed output checked too
        (tmp_path / "examples.txt").write_text(block.code)
        run([sys.executable, "-m", "doctest", "-o", "NORMALIZE_WHITESPACE", "examples.txt"], tmp_path)
        return
    (tmp_path / "block.py").write_text(python_source(block, before))
    run([sys.executable, "block.py"], tmp_path)
