"""Every page the code, tests and docs point a reader to exists: `docs/...md` named in a message, docstring or comment,
and every relative link of the README and docs/ (the docs moved once; a stale path is a dead end in an error message)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NAMED_PAGE = re.compile(r"docs/[a-z0-9_-]+(?:/[a-z0-9_.-]+)*\.(?:md|json|txt|png)\b")  # lower case: not a placeholder
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
ANCHORED_LINK = re.compile(r"\]\(([^)\s#]*\.md)?#([^)\s]+)\)")  # [text](page.md#anchor), or (#anchor) on the page
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "recipes").rglob("*.md"))]


def _sources():
    for folder in ("trl_padfree", "tests", "tools", "recipes", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in {".py", ".md", ".yaml", ".json", ".log", ".txt"} and path.is_file():
                yield path
    yield ROOT / "README.md"
    yield ROOT / "pyproject.toml"


def test_every_docs_path_named_in_the_repository_exists():
    missing = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in _sources()
        for name in NAMED_PAGE.findall(path.read_text(encoding="utf-8"))
        if not (ROOT / name).exists()
    }
    assert not missing, sorted(missing)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks are not links
    dead = [
        target
        for target in MARKDOWN_LINK.findall(text)
        if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists()
    ]
    assert not dead, dead


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    heading's anchor numbered."""
    anchors: set[str] = set()
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        numbered, count = anchor, 0
        while numbered in anchors:
            count += 1
            numbered = f"{anchor}-{count}"
        anchors.add(numbered)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_anchors_name_a_heading_of_their_page(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    dead = [
        f"{target or ''}#{anchor}"
        for target, anchor in ANCHORED_LINK.findall(text)
        if (page.parent / target if target else page).exists()
        and anchor not in heading_anchors(page.parent / target if target else page)
    ]
    assert not dead, dead


def test_the_metrics_page_lists_every_metric_the_package_logs():
    logged = set()
    for path in (ROOT / "trl_padfree").rglob("*.py"):
        logged |= set(re.findall(r"[\"'](padfree/[a-z_]+)[\"']", path.read_text(encoding="utf-8")))
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text(encoding="utf-8")
    assert len(logged) >= 10
    assert not [name for name in sorted(logged) if f"`{name}`" not in page]
