"""The architecture check (architecture.py, checks.py): decided on a tiny twin built from the config, so every dtype
and partitioning passes alike; exact architectures pass, leaking ones are refused with advice that works; the
`trl-padfree models` command (coverage.py).

Measured on the twins (float64, 2 CPU cores): exact architectures differ from each sequence alone by at most 2e-6 in
log-probs and 3e-5 of the largest gradient (Gemma 4, whose norms compute in float32); leaks measured 6e-4 (Falcon-H1's
Mamba scan run across the whole row, before mixers.py) to 1, so the tolerances (1e-4 both) sit between the two.
"""

import ast
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from legacy_attention import make_legacy_model
from packaging.version import Version
from tiny_architectures import POPULAR_TYPES
from tiny_fixtures import make_tokenizer
from trainer_utils import assert_same_step, make_trainer, one_step
from transformers import AutoConfig, Llama4ForConditionalGeneration

import trl_padfree
from trl_padfree.cli import main
from trl_padfree.cli.models import (
    check_model_type,
    check_vision_model_type,
    decoder_model_types,
    model_class_for,
    vision_language_types,
)
from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION, CHECKED_ON_CPU
from trl_padfree.modeling.check import packability as architecture
from trl_padfree.modeling.check.packability import (
    GRADIENT_TOLERANCE,
    LOG_PROB_TOLERANCE,
    architecture_verdict,
    check_architecture,
    check_packable,
    packing_errors,
)
from trl_padfree.modeling.check.twin import build_twin, twin_config
from trl_padfree.modeling.families import VISION_FAMILIES, catalog, unchecked_verdict
from trl_padfree.modeling.packed_forward import packed_row_limit
from trl_padfree.modeling.vision import cross_attention_refusal
from trl_padfree.refusals.models import check_packed_row_length


def tiny_model(model_type: str, dtype=torch.float32, attn_implementation: str = ATTN_IMPLEMENTATION):
    """A model of the twin's size, as a user would load it (its own weights, `dtype`)."""
    model_class, config = model_class_for(AutoConfig.for_model(model_type))
    config = twin_config(config)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return model_class(config).to(dtype)


@pytest.mark.parametrize("model_type", POPULAR_TYPES)
def test_popular_architectures_pack_exactly_on_padfree_varlen(model_type):
    row = check_model_type(model_type, (ATTN_IMPLEMENTATION,))

    verdict = row.verdicts[ATTN_IMPLEMENTATION]
    assert verdict.exact, verdict.reason
    assert verdict.errors.log_probs <= LOG_PROB_TOLERANCE / 10
    assert verdict.errors.gradients <= GRADIENT_TOLERANCE / 3
    assert verdict.errors.attention_calls > 0  # the model really ran padfree_varlen


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "gemma4_text", "olmo3"])
def test_bf16_models_are_accepted(model_type):
    # Refused before this check existed: half-precision weights could not be self-checked
    check_packable(tiny_model(model_type, torch.bfloat16))


def test_the_real_weights_are_never_read():
    # ZeRO-3 leaves empty placeholders where the weights were: the twin is built from the config alone
    model = tiny_model("qwen3_moe")
    for parameter in model.parameters():
        parameter.data = torch.empty(0)

    check_packable(model)


def test_the_verdict_is_measured_once_per_architecture(monkeypatch):
    model = tiny_model("qwen3")
    check_packable(model)
    builds = []
    monkeypatch.setattr(architecture, "build_twin", lambda *args: builds.append(args))

    check_packable(tiny_model("qwen3", torch.bfloat16))  # same architecture, other dtype and weights

    assert builds == []


def test_the_check_leaves_the_training_rng_alone(monkeypatch):
    monkeypatch.setattr(architecture, "_VERDICTS", {})
    model = tiny_model("llama")
    state = torch.get_rng_state()

    check_packable(model)

    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize(
    "model_type, attn_implementation, reason",
    [
        pytest.param("opt", "sdpa", "packed sequences see each other", id="opt-mask-from-positions"),
        pytest.param("bloom", ATTN_IMPLEMENTATION, "does not run its attention through", id="bloom-alibi"),
        pytest.param("jamba", ATTN_IMPLEMENTATION, "JambaMambaMixer layers carry state", id="jamba-mamba"),
    ],
)
def test_leaking_architectures_are_refused_with_the_reason(model_type, attn_implementation, reason):
    model = tiny_model(model_type, attn_implementation=attn_implementation)

    with pytest.raises(ValueError, match=reason) as refusal:
        check_packable(model)

    assert "padding_free=False" in str(refusal.value)


def test_the_advice_in_a_refusal_works_when_followed():
    # OPT packs on padfree_varlen (its positions come from position_ids) but not on sdpa (its mask ignores them)
    model = tiny_model("opt", attn_implementation="sdpa")
    with pytest.raises(ValueError, match="packed_attn_implementation=") as refusal:
        check_packable(model)
    advised = re.search(r"packed_attn_implementation='([\w]+)'", str(refusal.value)).group(1)

    model.set_attn_implementation(advised)
    check_packable(model)  # does not raise


def test_a_twin_that_cannot_be_built_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(architecture, "_VERDICTS", {})

    def fail(*args):
        raise architecture.TwinError("KeyError: 'full_attention'")

    monkeypatch.setattr(architecture, "build_twin", fail)

    with pytest.raises(ValueError, match=r"twin could not be built.*padding_free=False"):
        check_packable(tiny_model("llama"))


def test_the_reference_is_independent_of_padfree_varlen(monkeypatch):
    # Comparing padfree_varlen with itself would pass a feature it ignores: with chunked attention switched off,
    # Llama 4's chunked layers attend across chunk boundaries and the eager reference tells
    # Four layers keep both kinds (three chunked, one full) at a twelfth of the default 48 layers' cost
    twin = build_twin(*model_class_for(AutoConfig.for_model("llama4_text", num_hidden_layers=4)), ATTN_IMPLEMENTATION)
    assert packing_errors(twin, ATTN_IMPLEMENTATION).exact
    monkeypatch.setattr("trl_padfree.modeling.attention.interface.attention_chunk_size", lambda module: None)

    errors = packing_errors(twin, ATTN_IMPLEMENTATION)

    assert errors.log_probs > 100 * LOG_PROB_TOLERANCE


def test_twins_have_no_randomness_in_training_mode():
    # The check runs the twin in training mode too: a dropout left on would make a packed run differ from the
    # sequences alone by chance (Seed-OSS's residual_dropout, BioGPT's hidden_dropout_prob did, before)
    for model_type in ("seed_oss", "biogpt", "gpt2", "mixtral"):
        values = twin_config(AutoConfig.for_model(model_type)).to_dict()
        randomness = {name: value for name, value in values.items() if ("dropout" in name or "pdrop" in name
                      or "jitter" in name) and isinstance(value, float)}  # fmt: skip
        assert randomness and not any(randomness.values()), (model_type, randomness)


# The check's sequence lengths, chosen then rejected of each of its pairs: (9, 1, 13, 5)
CHECK_LENGTHS = tuple(pair[0] + pair[side] for side in (1, 2) for pair in architecture.CHECK_PAIRS)


def test_twins_keep_the_layer_pattern_and_cross_windows_and_chunks():
    config = AutoConfig.for_model("llama4_text")
    twin = twin_config(config)

    assert twin.layer_types == config.layer_types
    assert twin.num_hidden_layers == config.num_hidden_layers
    assert twin.attention_chunk_size < max(CHECK_LENGTHS)
    assert twin_config(AutoConfig.for_model("mistral")).sliding_window < max(CHECK_LENGTHS)
    assert twin.hidden_size <= 32 and twin.num_local_experts <= 4


def test_prefix_sharing_is_checked_on_the_twin_too():
    model_class, config = model_class_for(AutoConfig.for_model("llama4_text"))

    verdict = check_architecture(model_class, config, ATTN_IMPLEMENTATION, prefix_sharing=True)

    assert not verdict.exact and "chunked attention" in verdict.reason
    assert check_architecture(model_class, config, ATTN_IMPLEMENTATION).exact


def test_flash_kernels_are_checked_through_padfree_varlen():
    model = tiny_model("qwen3")
    model.config._attn_implementation = "flash_attention_2"  # cannot run on a CPU: its architecture can be checked

    assert architecture_verdict(model).attn_implementation == ATTN_IMPLEMENTATION


def test_llama4_rows_longer_than_its_temperature_tuning_floor_are_refused():
    config = AutoConfig.for_model("llama4_text")
    limit = packed_row_limit(config)
    assert limit == config.floor_scale - 1

    check_packed_row_length(config.model_type, limit, limit)  # does not raise
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        check_packed_row_length(config.model_type, limit + 1, limit)
    assert packed_row_limit(AutoConfig.for_model("llama")) is None


def test_decoder_model_types_leave_out_encoders():
    types = decoder_model_types()

    assert {"llama", "gpt_oss", "qwen3_5", "mamba"} <= set(types)
    assert not {"bert", "roberta", "bart", "whisper"} & set(types)


def test_models_command_prints_a_row_per_type(capsys):
    assert main(["models", "--types", "llama", "bloom", "--backends", ATTN_IMPLEMENTATION]) == 0

    output = capsys.readouterr().out
    assert re.search(r"llama\s+padfree_varlen=exact", output)
    assert re.search(r"bloom\s+padfree_varlen=refused", output)
    assert "2 model types" in output


def test_models_check_reads_only_a_config(tmp_path, capsys):
    AutoConfig.for_model("qwen3_moe").save_pretrained(tmp_path)  # a config.json, no weights

    assert main(["models", "--check", str(tmp_path), "--backends", ATTN_IMPLEMENTATION]) == 0

    output = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM" in output and "packs exactly" in output
    assert "padding_free=True trains it" in output


@pytest.mark.slow
def test_every_decoder_type_gets_a_verdict():
    # The generated table of docs/reference/models-table.md: every type exact, or refused with a reason
    for model_type in decoder_model_types():
        row = check_model_type(model_type)
        for verdict in row.verdicts.values():
            assert verdict.exact or verdict.reason, model_type


def legacy_model(seed: int):
    return make_legacy_model(seed, len(make_tokenizer()))


def test_auto_picks_the_backend_the_check_finds_exact(caplog):
    # A class that keeps its own attention code (it ignores padfree_varlen) but packs exactly on eager
    padded = make_trainer(False, attn_implementation="eager", model_factory=legacy_model)
    with caplog.at_level(logging.INFO, logger="trl_padfree.modeling.check.packability"):
        packed = make_trainer(True, attn_implementation="eager", model_factory=legacy_model)

    assert packed.model.config._attn_implementation == "eager"
    assert "packs exactly on `eager`" in caplog.text
    assert_same_step(one_step(padded), one_step(packed))


def test_an_explicit_backend_is_not_second_guessed():
    with pytest.raises(ValueError, match="does not run its attention through.*packed_attn_implementation='eager'"):
        make_trainer(True, attn_implementation="eager", model_factory=legacy_model,
                     packed_attn_implementation="padfree_varlen")  # fmt: skip


# Vision-language types: `trl-padfree models --vision` and `--check` on a vision-language config


@pytest.mark.parametrize(
    "model_type, model_class",
    [
        ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
        ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
        ("llava_next", "LlavaNextForConditionalGeneration"),
        ("internvl", "InternVLForConditionalGeneration"),
    ],
)
def test_models_check_gives_a_vision_language_config_its_verdict_on_image_pairs(
    model_type, model_class, tmp_path, capsys
):
    """A saved vision-language config, as a new user would pass it: checked as TRL's vision trainer loads it, on image
    pairs (Qwen-VL used to be refused as 'not a causal LM'; LLaVA-NeXT and InternVL were unchecked)."""
    AutoConfig.for_model(model_type).save_pretrained(tmp_path)

    assert main(["models", "--check", str(tmp_path), "--backends", ATTN_IMPLEMENTATION]) == 0

    output = capsys.readouterr().out
    assert model_class in output and "packs exactly" in output and "padding_free=True trains it" in output


def test_models_check_calls_a_family_without_twin_images_unchecked_not_exact(tmp_path, capsys):
    AutoConfig.for_model("fuyu").save_pretrained(tmp_path)

    assert main(["models", "--check", str(tmp_path), "--backends", *CHECKED_ON_CPU]) == 0

    output = capsys.readouterr().out
    assert "unchecked (" in output and "the check cannot give its twin images yet" in output
    assert "packs exactly" not in output
    assert "padding_free=True refuses it" in output
    assert output.count("unchecked") == 1  # the verdict every backend shares, said once


def test_a_family_looked_at_is_refused_with_its_reason_not_unchecked(tmp_path, capsys):
    AutoConfig.for_model("git").save_pretrained(tmp_path)

    assert main(["models", "--check", str(tmp_path), "--backends", *CHECKED_ON_CPU]) == 0

    output = capsys.readouterr().out
    assert "refused: its image features are a prefix of every batch row" in output and "unchecked" not in output
    assert "padding_free=False" in output and output.count("refused") == 1


# The records of image-text-to-text types newer than the floors' transformers (5.23), with the release that added each:
# the only records a transformers may not know, and only one older than that release (a misspelt type fails)
NEWER_THAN_THE_FLOOR = {
    "apertus1p5": "5.24.0",
    "hy_v4_vl": "5.24.0",
    "inkling2_loop": "5.24.0",
    "llava_onevision1_5": "5.25.0",
    "ovis2_5": "5.25.0",
    "pi05": "5.25.0",
}


def config_refusal(model_type: str) -> str | None:
    """Why `model_type`'s config alone refuses it on image data (an encoder-decoder, cross-attention), or None."""
    config = AutoConfig.for_model(model_type)
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder"
    return cross_attention_refusal(config)


def verdict_sources(records: dict, known: list[str]) -> tuple[list[str], list[str]]:
    """The inconsistencies between vision-family `records` and the `known` image-text-to-text types of the installed
    transformers, and the known types that have no verdict source yet (a release that added them after the records)."""
    problems = []
    for model_type, family in records.items():
        # A family with a layout may still be refused on image data whatever its twin measures (ERNIE-4.5-VL-MoE:
        # TRL's collator fails its padded forward): the refusal decides; never both refused and unchecked
        if family.refused and family.unchecked:
            problems.append(f"{model_type}: refused and unchecked")
        if not (family.exact or family.refused or family.unchecked):
            problems.append(f"{model_type}: a record without a verdict")
        if model_type in known:
            if reason := config_refusal(model_type):
                problems.append(f"{model_type}: a record, and its config refuses it too ({reason})")
        elif Version(transformers.__version__) >= Version(NEWER_THAN_THE_FLOOR.get(model_type, "0")):
            problems.append(f"{model_type}: a record for a type transformers {transformers.__version__} does not know")
    unrecorded = sorted(model_type for model_type in set(known) - set(records) if config_refusal(model_type) is None)
    return problems, unrecorded


def test_every_image_text_to_text_type_has_one_verdict_source():
    """A type with a record (modeling/families/: exact, refused or unchecked, one verdict each), or one its config
    refuses (encoder-decoders, cross-attention): never two. A record names a type of the installed transformers or of a
    newer one (`NEWER_THAN_THE_FLOOR`). A type of the installed transformers with neither is no failure: a release that
    only adds model types must not fail CI. It is reported (a warning naming it) and is "unchecked (no record of its
    image layout)": `trl-padfree models --vision` lists it so, and padding_free=True refuses it on image data."""
    problems, unrecorded = verdict_sources(VISION_FAMILIES, vision_language_types())

    assert problems == []
    for model_type in unrecorded:
        verdicts = check_vision_model_type(model_type, CHECKED_ON_CPU).verdicts.values()
        assert all(verdict.reason == unchecked_verdict(model_type) for verdict in verdicts), model_type
    if unrecorded:
        warnings.warn(
            f"transformers {transformers.__version__}'s image-text-to-text types {unrecorded} have no record in "
            "trl_padfree/modeling/families/: unchecked until they have one",
            stacklevel=1,
        )


def test_a_type_without_a_record_is_listed_unchecked_not_failed(monkeypatch, capsys):
    # As a newer transformers' type is: Qwen2.5-VL with its record taken away
    monkeypatch.delitem(catalog.VISION_FAMILIES, "qwen2_5_vl")
    monkeypatch.delitem(catalog.IMAGE_FAMILIES, "qwen2_5_vl")

    problems, unrecorded = verdict_sources(catalog.VISION_FAMILIES, vision_language_types())

    assert problems == [] and unrecorded == ["qwen2_5_vl"]
    assert main(["models", "--vision", "--types", "qwen2_5_vl", "--backends", *CHECKED_ON_CPU]) == 0
    output = capsys.readouterr().out
    assert re.search(r"qwen2_5_vl\s+padfree_varlen=unchecked\s+sdpa=unchecked\s+eager=unchecked", output)
    assert "no record of its image layout" in unchecked_verdict("qwen2_5_vl")


def test_two_verdict_sources_or_an_unknown_type_fail_the_check():
    records = dict(VISION_FAMILIES)
    records["mllama"] = records["fuyu"]  # its config already refuses it (cross-attention)
    records["qwen9_vl"] = records["qwen2_5_vl"]  # a type no transformers knows

    problems, _ = verdict_sources(records, vision_language_types())

    assert len(problems) == 2
    assert problems[0].startswith("mllama: a record, and its config refuses it too (its images reach")
    assert problems[1] == f"qwen9_vl: a record for a type transformers {transformers.__version__} does not know"


MODELS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "models-table.md"
PAGE_TABLES = {"decoder-only": decoder_model_types, "image-text-to-text": vision_language_types}


def page_table(kind: str) -> tuple[str, dict[str, list[str]]]:
    """The transformers version the generated models page's table of `kind` types was generated on, and its rows: each type's
    verdict cells, one per backend."""
    section = MODELS_PAGE.read_text().split(f"## Every {kind} type of transformers ", 1)[1].split("\n## ", 1)[0]
    version = section.split(None, 1)[0]
    rows = {
        line.split("|")[1].strip().strip("`"): [cell.strip() for cell in line.split("|")[3 : 3 + len(CHECKED_ON_CPU)]]
        for line in section.splitlines()
        if line.startswith("| `")
    }
    return version, rows


@pytest.mark.parametrize("kind", PAGE_TABLES)
def test_the_models_page_lists_the_types_of_the_transformers_it_was_generated_on(kind):
    """docs/reference/models-table.md's tables are `trl-padfree models --markdown` on the transformers release each
    names.
    Compared with the installed release: on that release, the same types; on a newer one, no type the page lists is
    missing (the types it adds are not on the page until it is generated again, and `trl-padfree models` lists them
    meanwhile, a vision type without a record as unchecked); on an older one, every installed type is on the page."""
    version, rows = page_table(kind)
    installed, listed = set(PAGE_TABLES[kind]()), set(rows)
    if Version(transformers.__version__) == Version(version):
        assert listed == installed
    elif Version(transformers.__version__) > Version(version):
        assert listed <= installed, sorted(listed - installed)
    else:
        assert installed <= listed, sorted(installed - listed)


def test_the_models_page_gives_each_refused_or_unchecked_record_its_verdict():
    """A record that refuses a type, or leaves it unchecked, decides its row of the generated vision table on every
    backend without measuring: a record changed since the page was generated fails here (the page's types only)."""
    _, rows = page_table("image-text-to-text")
    stale = {}
    for model_type, cells in rows.items():
        family = VISION_FAMILIES.get(model_type)
        if family is not None and (family.refused or family.unchecked):
            kind = "refused" if family.refused else "unchecked"
            if cells != [kind] * len(CHECKED_ON_CPU):
                stale[model_type] = (kind, cells)
    assert stale == {}


# Library code that names a vision family by its model type outside its record: the vision benchmark's model; and the
# git command the bench's provenance runs, which GIT's model type spells too
NAMED_OUTSIDE_THE_RECORDS = {("cli/bench/vision.py", "qwen2_5_vl"), ("cli/bench/report.py", "git")}


def test_a_vision_family_is_named_only_in_its_record():
    """Everything trl-padfree knows of a vision family is its record, in the module of its image layout
    (modeling/families/): no other library module names its model type, so adding a family edits one file."""
    package = Path(trl_padfree.__file__).parent
    named = set()
    for path in package.rglob("*.py"):
        if "families" in path.relative_to(package).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in VISION_FAMILIES:
                named.add((path.relative_to(package).as_posix(), node.value))
    assert named == NAMED_OUTSIDE_THE_RECORDS


def test_a_forward_that_fails_unpacked_too_says_so():
    """Llama 4's forward raises on transformers 5.24 on every input, padded too: the verdict says so, not that
    packing failed (on 5.23 it packs exactly)."""
    verdict = check_architecture(
        Llama4ForConditionalGeneration, AutoConfig.for_model("llama4"), ATTN_IMPLEMENTATION, images=True
    )
    assert verdict.exact or (
        verdict.reason.startswith("its forward fails on a tiny twin without packing too")
        and "no padded result to pack equal to" in verdict.reason
    ), verdict.reason


def test_a_cross_attention_model_is_refused_with_the_reason_and_the_way_out(tmp_path, capsys):
    AutoConfig.for_model("mllama").save_pretrained(tmp_path)

    assert main(["models", "--check", str(tmp_path), "--backends", ATTN_IMPLEMENTATION]) == 0

    output = capsys.readouterr().out
    assert "through cross-attention" in output and "padding_free=False" in output and "packs exactly" not in output


def test_a_prefix_lm_is_refused_with_the_reason_and_how_trl_trains_it(tmp_path, capsys):
    AutoConfig.for_model("paligemma").save_pretrained(tmp_path)

    assert main(["models", "--check", str(tmp_path), "--backends", ATTN_IMPLEMENTATION]) == 0

    output = capsys.readouterr().out
    assert "a prefix-LM" in output and "padding_free=False" in output and "packs exactly" not in output
    assert "token_type_ids 1" in output  # the processor TRL's padded trainer needs


def test_models_vision_sweep_lists_every_image_text_to_text_type(capsys):
    types = ["qwen2_vl", "fuyu", "paligemma", "vision-encoder-decoder"]
    assert main(["models", "--vision", "--types", *types, "--backends", ATTN_IMPLEMENTATION]) == 0

    output = capsys.readouterr().out
    assert re.search(r"qwen2_vl\s+padfree_varlen=exact", output)
    assert re.search(r"fuyu\s+padfree_varlen=unchecked", output)
    assert re.search(r"paligemma\s+padfree_varlen=refused", output)
    assert re.search(r"vision-encoder-decoder\s+padfree_varlen=refused", output)
    assert {"qwen2_5_vl", "llava_next", "internvl", "mllama"} <= set(vision_language_types())
