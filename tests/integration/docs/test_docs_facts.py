"""What the docs state that the repository can check: metric and config names, run times and counts quoted from
generated output, the GPU tests' outcome, the size of the hand-written docs, and that no page reads as history.

Nothing here imports trl_padfree or TRL (TRL's trainer is read as source), so this file runs in about a second.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from tools import generate_docs

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MODELS = DOCS / "reference" / "models.md"
MODELS_TABLE = DOCS / "reference" / "models-table.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
CONFIGS = ROOT / "trl_padfree" / "cli" / "configs"
ACCELERATE_CONFIGS = ROOT / "trl_padfree" / "cli" / "accelerate_configs"
MAX_HAND_WRITTEN_WORDS = 30_000


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def flat(path: Path) -> str:
    """The page with its line breaks as spaces, so that a sentence wrapped over lines matches one pattern."""
    return " ".join(text(path).split())


# ---- the size of the hand-written docs ----


def is_generated(path: Path) -> bool:
    """A page says "generated" in its first five lines (tools/generate_docs.py's note, the models table's)."""
    return "generated" in "\n".join(text(path).splitlines()[:5]).lower()


def hand_written_words(path: Path) -> int:
    """Words as `wc -w` counts them: runs of non-space characters, code blocks and tables included."""
    return len(text(path).split())


def test_the_hand_written_docs_stay_within_their_word_budget():
    counts = {str(page.relative_to(ROOT)): hand_written_words(page) for page in PAGES if not is_generated(page)}
    assert sum(counts.values()) <= MAX_HAND_WRITTEN_WORDS, sorted(counts.items(), key=lambda item: -item[1])


def test_the_readme_stays_within_its_word_budget():
    assert hand_written_words(README) <= 1_500


def test_the_generated_pages_say_so():
    generated = {page.name for page in PAGES if is_generated(page)}
    assert generated >= {"config.md", "errors.md", "benchmarks.md", "models-table.md"}, generated
    assert {ROOT / page for page in generate_docs.PAGES} <= {page for page in PAGES if is_generated(page)}
    assert not is_generated(MODELS) and not is_generated(README)


# ---- no history ----

# Phrases that describe what the product used to do; a page says what it does now, and a figure's provenance lives in
# its benchmark file (docs/bench/) or the benchmarks page generated from it
HISTORY = [
    r"\bbefore, every\b",
    r"\ban earlier (?:harness|bench|design)\b",
    r"\bthe earlier\b",
    r"\btoo large today\b",
    r"\bfixed since\b",
    r"\((?:now|before)\)",  # a table column of then and now
    r": before \|",  # a table row of then
    r"\bused to\b",
    r"\bthe current (?:bench|layout|design|harness)\b",
    r"docs/gpu\.md",  # a page that no longer exists
    r"\bits one run\b",
    r"\bafter the two fixes\b",
    r"\bwhich no GPU has timed\b",
    r"\bpreviously\b",
]


@pytest.mark.parametrize(
    "path", [*PAGES, *sorted((DOCS / "bench").glob("*.log"))], ids=lambda path: str(path.relative_to(ROOT))
)
def test_no_page_reads_as_history(path):
    found = [match[0] for pattern in HISTORY for match in re.finditer(pattern, flat(path), re.IGNORECASE)]
    assert not found, found


# ---- metric names ----

METRIC_NAME = re.compile(r"`((?:padfree|rewards|logps|logits|balance)/[a-z_*]+)`")


def package_source(package: str, relative: str) -> str:
    return (Path(importlib.util.find_spec(package).submodule_search_locations[0]) / relative).read_text()


def logged_metrics() -> set[str]:
    ours = set()
    for path in (ROOT / "trl_padfree").rglob("*.py"):
        ours |= set(re.findall(r"[\"'](padfree/[a-z_]+)[\"']", text(path)))
    trl = set(re.findall(r'_metrics\[mode\]\["([\w/]+)"\]', package_source("trl", "trainer/dpo_trainer.py")))
    return ours | trl


def test_every_metric_the_docs_name_is_logged():
    logged = logged_metrics()
    assert {"padfree/real_tokens", "rewards/margins", "logps/chosen"} <= logged
    prefixes = {name.split("/")[0] for name in logged}
    unknown = {
        f"{page.relative_to(ROOT)}: {name}"
        for page in PAGES
        for name in METRIC_NAME.findall(text(page))
        if name not in logged and not (name.endswith("/*") and name.split("/")[0] in prefixes)
    }
    assert not unknown, sorted(unknown)


# ---- config names ----

NAMED_CONFIG = re.compile(r"(--config|--accelerate_config|configs (?:show|copy))[ =]([\w.\-]+)")


def shipped(folder: Path) -> set[str]:
    return {path.stem for path in folder.glob("*.yaml")}


def is_placeholder(name: str) -> bool:
    return name.startswith(("my", ".")) or name.isupper() or name.endswith(".yaml")


def test_every_config_the_docs_name_ships():
    kinds = {"--config": shipped(CONFIGS), "--accelerate_config": shipped(ACCELERATE_CONFIGS)}
    kinds["configs show"] = kinds["configs copy"] = kinds["--config"] | kinds["--accelerate_config"]
    assert len(kinds["--config"]) >= 5 and len(kinds["--accelerate_config"]) >= 5
    unknown = {
        f"{page.relative_to(ROOT)}: {flag} {name}"
        for page in PAGES
        for flag, name in NAMED_CONFIG.findall(text(page))
        if not is_placeholder(name) and name not in kinds[flag]
    }
    assert not unknown, sorted(unknown)


def first_column(page: Path, header: str) -> list[str]:
    """The backticked names in the first column of the table under the header row that starts with `header`."""
    lines = text(page).splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1:-1])
    return [[cell.strip() for cell in row] for row in rows]


def test_the_engine_table_lists_every_shipped_accelerate_config():
    rows = first_column(DOCS / "guides" / "multi-gpu.md", "| Name | Policy |")
    assert {row[0].strip("`") for row in rows} == shipped(ACCELERATE_CONFIGS)


def test_the_data_table_gives_each_shipped_config_its_dataset():
    rows = first_column(DOCS / "guides" / "coming-from-trl.md", "| Config | `dataset_name` |")
    listed = {row[0].strip("`"): row[1].strip("`") for row in rows}
    datasets = {path.stem: yaml.safe_load(text(path))["dataset_name"] for path in CONFIGS.glob("*.yaml")}
    assert listed == datasets


# ---- times and outcomes quoted from generated output ----


def sweep_seconds(section_title: str) -> int:
    section = text(MODELS_TABLE).split(f"## {section_title}", 1)[1].split("\n## ", 1)[0]
    return int(re.search(r"model types, transformers [\d.]+, (\d+) s in all", section)[1])


def test_the_vision_sweep_time_is_the_generated_tables():
    seconds = sweep_seconds("Every image-text-to-text type of transformers")
    assert f"the sweep took {seconds} s" in flat(DOCS / "guides" / "vision-language.md")
    assert f"2 CPU cores, {seconds} s)" in flat(MODELS_TABLE)


def test_the_suite_time_is_stated_once():
    """The default suite's run time lives in the README; another page stating one would drift from it."""
    stated = [
        f"{page.relative_to(ROOT)}: {line.strip()}"
        for page in PAGES
        for line in text(page).splitlines()
        if re.search(r"python -m pytest\b.*\bminutes?\b", line)
    ]
    assert len(stated) == 1 and stated[0].startswith("README.md"), stated


# ---- claims the code contradicts ----

# Each pattern is a claim a page once made that the code does not keep; the reason says what holds instead
CONTRADICTED = {
    r"padding_free=False[^.]{0,80}\bbit for bit\b": "the model card is tagged and gains a section in both modes",
    r"\banswers at once\b": "state no speed for --help that no test measures",
    r"\bembedded default\b": "`trl-padfree dpo` without --config applies no config",
}


@pytest.mark.parametrize(
    "path", [*PAGES, *sorted(CONFIGS.glob("*.yaml"))], ids=lambda path: str(path.relative_to(ROOT))
)
def test_no_page_makes_a_claim_the_code_contradicts(path):
    found = [
        f"{match[0]!r}: {reason}"
        for pattern, reason in CONTRADICTED.items()
        for match in re.finditer(pattern, flat(path), re.IGNORECASE)
    ]
    assert not found, found


def passages(path: Path) -> list[str]:
    """The page's paragraphs, list items and table rows, each on one line."""
    pieces = re.split(r"\n(?=\s*(?:- |\|)|\s*\n)", text(path))
    return [" ".join(piece.split()) for piece in pieces if piece.strip()]


def offloads_the_reference(config: Path) -> bool:
    """`ref_offload` needs ZeRO-3 or FSDP2 (refusals.placement.check_ref_offload_applies)."""
    settings = yaml.safe_load(text(config))
    zero_stage = (settings.get("deepspeed_config") or {}).get("zero_stage")
    fsdp_version = (settings.get("fsdp_config") or {}).get("fsdp_version")
    return zero_stage == 3 or fsdp_version == 2


def test_every_config_named_beside_ref_offload_can_offload_the_reference():
    configs = {path.stem: path for path in ACCELERATE_CONFIGS.glob("*.yaml")}
    assert {name for name, path in configs.items() if not offloads_the_reference(path)} >= {"zero2", "multi_gpu"}
    wrong = {
        f"{page.relative_to(ROOT)}: `{name}` in {passage[:100]!r}"
        for page in PAGES
        for passage in passages(page)
        if "ref_offload" in passage
        for name in re.findall(r"`([\w.]+)`", passage)
        if name in configs and not offloads_the_reference(configs[name])
    }
    assert not wrong, sorted(wrong)


def test_the_headline_calls_a_run_host_bound_only_where_its_file_records_host_time():
    rows = [line for line in text(DOCS / "benchmarks.md").splitlines() if line.startswith("|") and "(bench/" in line]
    assert rows
    for row in rows:
        if "host-bound" in row:
            bench = re.search(r"bench/[\w.\-]+\.json", row)[0]
            assert "host_bound" in text(DOCS / bench), f"{bench} records no host time, so nothing in it is host-bound"


def test_every_shipped_config_trains_padding_free_as_the_guide_says():
    assert "every shipped config also sets `padding_free: true`" in flat(DOCS / "guides" / "coming-from-trl.md")
    assert not [
        path.stem for path in CONFIGS.glob("*.yaml") if yaml.safe_load(text(path)).get("padding_free") is not True
    ]
