"""The generated docs pages match what they are generated from (tools/generate_docs.py).

Nothing here imports trl_padfree or TRL: the config is read from source, so this file runs in about a second.
"""

import ast
import re
import textwrap

import pytest

from tools import generate_docs
from tools.generate_docs import Field, docstring_problems, parse_docstring

REGENERATE = "run `python -m tools.generate_docs` from the repository root and commit the page"


@pytest.mark.parametrize("page", sorted(generate_docs.PAGES))
def test_committed_page_is_the_generator_output(page):
    committed = (generate_docs.ROOT / page).read_text()
    assert committed == generate_docs.PAGES[page](), f"{page} is stale: {REGENERATE}"


def test_dpo_config_docstring_documents_every_field_with_its_default():
    assert generate_docs.config_problems() == []


def test_config_reference_lists_every_added_field():
    added, _ = generate_docs.config_fields()
    page = generate_docs.config_reference()
    assert added, "no field found in trl_padfree/config.py's DPOConfig"
    for name in added:
        assert f"### `{name}`" in page


def test_benchmarks_page_shows_every_bench_file():
    page = generate_docs.benchmarks_page()
    for path in sorted(generate_docs.BENCH.glob("*.json")):
        assert f"(bench/{path.name})" in page, f"{path.name} has no table in docs/benchmarks.md"


def test_every_bench_table_states_machine_versions_command_and_date():
    page = generate_docs.benchmarks_page()
    sections = re.split(r"\n### ", page)[1:]
    for section in sections:
        if "**Data**" not in section:  # the GPU-run instructions
            continue
        assert "**Machine**" in section and "```bash" in section and re.search(r"\d{4}-\d{2}-\d{2}", section)
        assert "**Measured**" in section or "**Simulated**" in section, section.splitlines()[0]


def test_every_bench_table_says_whether_its_rows_ran_with_activation_checkpointing():
    # `trl-padfree bench` turns it on by default; a file whose rows lack the field ran without it
    sections = re.split(r"\n### ", generate_docs.benchmarks_page())[1:]
    benched = [section for section in sections if "\ntrl-padfree bench " in section]
    assert len(benched) >= 6
    for section in benched:
        assert "activation checkpointing" in section, section.splitlines()[0]
    note = generate_docs.checkpointing_note
    assert "ran without activation checkpointing" in note([{"speedup": 2.0}])
    assert note([{"activation_checkpointing": True}]) == "Activation checkpointing on in every mode (TRL's default)."
    assert "off in every mode" in note([{"activation_checkpointing": False}])


DOCSTRING = textwrap.dedent(
    """
    Intro line one,
    continued.

    `padding_free=True` is honoured.

    > Parameters that control a concern

        budget (`int` or `None`, *optional*, defaults to `None`):
            First paragraph,
            wrapped.

            Second paragraph (with `code`):
                an indented example.

        mode (`str`, *optional*, defaults to `"auto"`):
            One line.

    > Parameters that control another

        train_sampling_strategy (`str`, *optional*, defaults to `"random"`):
            TRL's field, honoured.
    """
)
ADDED = {"budget": Field("budget", "int | None", "None"), "mode": Field("mode", "str", '"auto"')}
INHERITED = {
    "train_sampling_strategy": Field("train_sampling_strategy", "str", '"random"'),
    "padding_free": Field("padding_free", "bool", "False"),
}


def test_parse_docstring_reads_hf_style_entries_and_groups():
    intro, options = parse_docstring(DOCSTRING)
    assert intro == ["Intro line one, continued.", "`padding_free=True` is honoured."]
    assert [(o.name, o.type, o.default, o.group) for o in options] == [
        ("budget", "`int` or `None`", "None", "Parameters that control a concern"),
        ("mode", "`str`", '"auto"', "Parameters that control a concern"),
        ("train_sampling_strategy", "`str`", '"random"', "Parameters that control another"),
    ]
    assert options[0].text == "First paragraph, wrapped.\n\nSecond paragraph (with `code`): an indented example."


def test_docstring_problems_name_missing_extra_and_wrong_defaults():
    assert docstring_problems(DOCSTRING, ADDED, INHERITED) == []
    missing = {**ADDED, "window": Field("window", "int", "1000")}
    assert docstring_problems(DOCSTRING, missing, INHERITED) == [
        "`window` is a field of DPOConfig but its docstring does not document it"
    ]
    absent = {"mode": ADDED["mode"]}
    assert docstring_problems(DOCSTRING, absent, INHERITED) == [
        "`budget` is documented but is not a field of DPOConfig"
    ]
    changed = {**ADDED, "mode": Field("mode", "str", '"keep"')}
    assert docstring_problems(DOCSTRING, changed, INHERITED) == [
        '`mode`: the docstring says defaults to "auto", the field "keep"'
    ]


def test_check_mode_names_a_stale_page(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(generate_docs, "ROOT", tmp_path)
    assert generate_docs.main(["--check"]) == 1
    assert "docs/benchmarks.md is stale" in capsys.readouterr().err
    assert generate_docs.main([]) == 0
    assert generate_docs.main(["--check"]) == 0


REFUSALS_SOURCE = textwrap.dedent(
    '''
    NAME = "padfree_varlen"

    # ---- the config ----


    def check_size(size: int, padding_free: bool) -> None:
        """Not in the page: the messages are."""
        if size > 1 and not padding_free:
            raise ValueError(f"size={size} needs padding_free=True: set it, or `{NAME}` for {list(size)}.")


    # ---- engines ----


    def refuse_engine(what: str, working) -> None:
        message = f"{what}=True cannot run on `{what}`."
        if working:
            message += f" Use {working[0]!r}."
        else:
            message += " Train padded."
        raise RuntimeError(message)


    def check_quiet(flag: bool) -> None:
        if flag:
            raise
    '''
)


def test_refusal_sections_render_each_message_by_section():
    sections = generate_docs.refusal_sections(REFUSALS_SOURCE)
    assert list(sections) == ["the config", "engines"]
    assert [(r.function, r.error, r.message) for r in sections["the config"]] == [
        ("check_size", "ValueError", "size=*size* needs padding_free=True: set it, or `padfree_varlen` for *size*.")
    ]
    # a message built in steps gives one line per way it can end; a placeholder in code reads <name>
    assert [r.message for r in sections["engines"]] == [
        "*what*=True cannot run on `<what>`. Use *working[0]*.",
        "*what*=True cannot run on `<what>`. Train padded.",
    ]
    assert {r.error for r in sections["engines"]} == {"RuntimeError"}


def test_errors_page_names_every_refusal_that_raises():
    raising = {
        node.name
        for source in generate_docs.refusal_modules().values()
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and any(isinstance(inner, ast.Raise) for inner in ast.walk(node))
    }
    page = generate_docs.errors_page()
    assert len(raising) >= 50
    assert not [name for name in sorted(raising) if f"`{name}`" not in page]
    assert "\x00" not in page and "\x01" not in page, "a placeholder was left unmarked"


def test_errors_page_has_a_section_per_refusals_module():
    # Each module of refusals/ is one section, titled by its `# ---- title ----` comment
    titles = [list(generate_docs.refusal_sections(source)) for source in generate_docs.refusal_modules().values()]
    assert all(len(module_titles) == 1 for module_titles in titles), titles
    headings = [line[3:] for line in generate_docs.errors_page().splitlines() if line.startswith("## ")]
    assert headings == [f"{title[:1].upper()}{title[1:]}" for (title,) in titles]


def test_a_refusals_module_left_off_the_page_is_an_error(monkeypatch):
    monkeypatch.setattr(generate_docs, "REFUSAL_MODULES", generate_docs.REFUSAL_MODULES[:-1])
    with pytest.raises(ValueError, match="differs from refusals/'s modules"):
        generate_docs.errors_page()
