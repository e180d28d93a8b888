"""Every headline figure is reproducible and equals, to its printed precision, the value in the JSON it names: the
headline table of docs/benchmarks.md, and the README's one-line summary of it.

A row of the table reads

    | 2.02x, 1.18x | what | where and how | kind | [`bench/FILE.json`](...) | `PATH` `PATH` |

with one backticked expression in the last column per number in the first, in order. An expression is a path into the
JSON, optionally multiplied or divided by another path or a number: `100 * [backend=x].fraction`, `a.b / a.c`. A path
is a chain of `.key`, `[3]` (a list index) and `[key=value,key=value]` (the one list element whose fields match).
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")
STEP = re.compile(r"\.?([\w\-+]+)|\[([^\]]+)\]")


def evidence_rows() -> list[list[str]]:
    lines = BENCHMARKS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Figure |") and "| Evidence |" in line)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def follow(data, path: str):
    for key, selector in STEP.findall(path.strip()):
        if key:
            data = data[int(key)] if isinstance(data, list) else data[key]
        elif selector.strip().isdigit():
            data = data[int(selector)]
        else:
            wanted = dict(part.split("=", 1) for part in selector.split(","))
            matches = [item for item in data if all(str(item.get(k)) == v for k, v in wanted.items())]
            assert len(matches) == 1, f"{selector!r} matches {len(matches)} elements"
            data = matches[0]
    return data


def evaluate(data, expression: str) -> float:
    tokens = re.split(r"\s+([*/])\s+", expression.strip())
    value = None
    operator = None
    for token in tokens:
        if token in ("*", "/"):
            operator = token
            continue
        operand = float(token) if re.fullmatch(r"\d+(\.\d+)?", token) else float(follow(data, token))
        if value is None:
            value = operand
        elif operator == "*":
            value *= operand
        else:
            value /= operand
    return value


def test_the_table_is_there():
    assert len(evidence_rows()) >= 5


@pytest.mark.parametrize("row", evidence_rows(), ids=lambda row: row[0])
def test_each_figure_matches_its_json(row):
    figure, evidence, values = row[0], row[-2], row[-1]
    files = re.findall(r"bench/[\w.\-]+\.json", evidence)
    assert len(set(files)) == 1, f"name one JSON file in {evidence!r}"
    data = json.loads((ROOT / "docs" / files[0]).read_text())
    assert data["provenance"]["reproducible"], f"{files[0]} is not reproducible with today's command: no headline"
    printed = NUMBER.findall(figure)
    expressions = re.findall(r"`([^`]+)`", values)
    assert printed and len(printed) == len(expressions), (
        f"{figure!r}: {len(printed)} figures, {len(expressions)} values"
    )
    for text, expression in zip(printed, expressions, strict=True):
        decimals = len(text.split(".")[1]) if "." in text else 0
        value = evaluate(data, expression)
        assert abs(value - float(text.replace(",", ""))) <= 0.5 * 10**-decimals + 1e-9, (
            f"README says {text}, {files[0]} gives {value} for {expression}"
        )


def test_the_readme_summary_quotes_only_headline_figures():
    readme = " ".join(README.read_text().split())
    summary = readme.split("## Evidence", 1)[1].split("## ", 1)[0]
    headline = [row[0] for row in evidence_rows()]  # the figure cells, each checked against its file above
    quoted = re.findall(r"\d[\d.,]*(?:-\d[\d.,]*)?[x%]", summary)
    assert quoted and all(any(figure in cell for cell in headline) for figure in quoted), (quoted, headline)


MODELS_TABLE = ROOT / "docs" / "reference" / "models-table.md"
MODELS_PAGE = ROOT / "docs" / "reference" / "models.md"


def padfree_varlen_cells(section_title: str) -> list[str]:
    """The padfree_varlen verdict of each type in the generated table under `section_title` of models.md."""
    section = MODELS_TABLE.read_text().split(f"## {section_title}", 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[3].strip() for line in section.splitlines() if line.startswith("| `")]


def exact_types(section_title: str) -> tuple[int, int]:
    cells = padfree_varlen_cells(section_title)
    return cells.count("exact"), len(cells)


def test_the_readme_counts_the_types_the_generated_tables_list():
    readme = " ".join(README.read_text().split())
    text = re.search(r"(\d+) of the (\d+) decoder-only types pack exactly", readme)
    vision = re.search(r"and (\d+) of the (\d+) image-text-to-text types", readme)
    assert text and vision, "the README's type counts moved: update this test"
    assert tuple(map(int, text.groups())) == exact_types("Every decoder-only type of transformers")
    assert tuple(map(int, vision.groups())) == exact_types("Every image-text-to-text type of transformers")


def verdict_rows(section_title: str) -> list[list[str]]:
    """Each type's verdict cells (padfree_varlen, sdpa, eager) in the generated table under `section_title`."""
    section = MODELS_TABLE.read_text().split(f"## {section_title}", 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.split("|")[3:6]] for line in section.splitlines() if line.startswith("| `")]


def verdict_counts(section_title: str) -> dict[str, int]:
    """Types exact on padfree_varlen, exact only on another backend, unchecked, refused on every backend."""
    rows = verdict_rows(section_title)
    exact_elsewhere = [row for row in rows if row[0] != "exact" and "exact" in row]
    unchecked = [row for row in rows if row[0] == "unchecked"]
    exact = [row for row in rows if row[0] == "exact"]
    return {
        "types": len(rows),
        "exact": len(exact),
        "exact elsewhere": len(exact_elsewhere),
        "unchecked": len(unchecked),
        "refused": len(rows) - len(exact) - len(exact_elsewhere) - len(unchecked),
    }


VISION = "Every image-text-to-text type of transformers"
DECODERS = "Every decoder-only type of transformers"


def test_the_vision_guide_counts_the_verdicts_the_generated_table_lists():
    guide = " ".join((ROOT / "docs" / "guides" / "vision-language.md").read_text().split())
    found = re.search(
        r"(\d+) of the (\d+) image-text-to-text types pack exactly: (\d+) on `padfree_varlen`, HY-V4-VL on `eager` "
        r"only and Mistral Large 3 on `sdpa` only .*?; (\d+) are refused and (\d+) unchecked",
        guide,
    )
    assert found, "the vision guide's counts moved: update this test"
    counts = verdict_counts(VISION)
    assert counts["exact elsewhere"] == 2, "name the types exact on another backend only in the guide"
    assert tuple(map(int, found.groups())) == (
        counts["exact"] + counts["exact elsewhere"],
        counts["types"],
        counts["exact"],
        counts["refused"],
        counts["unchecked"],
    )


def test_the_models_page_counts_the_verdicts_its_tables_list():
    page = " ".join((MODELS_PAGE.read_text() + MODELS_TABLE.read_text()).split())
    text = re.search(
        r"(\d+) of (\d+) decoder-only types pack exactly on `padfree_varlen`, (\d+) on some backend", page
    )
    vision = re.search(
        r"On `padfree_varlen`: (\d+) exact, (\d+) refused, (\d+) unchecked; (\d+) exact on some backend", page
    )
    assert text and vision, "models.md's counts moved: update this test"
    decoders = verdict_counts(DECODERS)
    assert tuple(map(int, text.groups())) == (
        decoders["exact"],
        decoders["types"],
        decoders["exact"] + decoders["exact elsewhere"],
    )
    images = verdict_counts(VISION)
    assert tuple(map(int, vision.groups())) == (
        images["exact"],
        images["types"] - images["exact"] - images["unchecked"],
        images["unchecked"],
        images["exact"] + images["exact elsewhere"],
    )
