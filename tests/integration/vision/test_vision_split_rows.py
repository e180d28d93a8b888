"""Sequence and context parallelism on vision-language rows, for real: two or four CPU processes over gloo share each
packed row (`accelerate launch`, tests/support/distributed/train_dpo.py --vision), against TRL's padded vision trainer in one
process on the same global batches (tolerances.DISTRIBUTED_*, grad_norm included).

Every rank runs the model's own forward up to its language model on the whole row: the text embeddings, the vision
tower on the rank's share of the row's images with every rank's features gathered (parallel/image_shares.py), their
features placed on the image tokens, the positions (Qwen-VL's `get_rope_index`); the language model then runs this
rank's chunk (parallel/row_split.py, `language_model_on_chunk`). The rows are long enough that sequences, and images,
cross the chunk boundaries.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("deepspeed")

from distributed_runs import (  # noqa: E402
    assert_no_object_collective,
    assert_same_training,
    assert_split_row_training,
    launch,
    train_in_this_process,
)
from tiny_vision import (  # noqa: E402
    MINICPM_FAMILIES,
    MOE_FAMILIES,
    VISION_FAMILIES,
    make_vision_config,
    make_vision_processor,
    save_vision_models,
)
from tolerances import (  # noqa: E402
    DISTRIBUTED_GRAD_ATOL,
    DISTRIBUTED_METRIC_RTOL,
    DISTRIBUTED_METRIC_RTOL_BY_FAMILY,
    FIRST_LOSS_ATOL,
)

from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION, EXACT_UNDER_ULYSSES  # noqa: E402
from trl_padfree.parallel.ulysses import check_ulysses_model  # noqa: E402

# HyperCLOVAX-Vision-V2: Qwen-VL's patches on plain positions (no get_rope_index)
PLAIN_POSITIONS = ("hyperclovax_vision_v2",)
# Qwen2.5-VL: mRoPE positions from the whole row; Qwen3-VL: deepstack features added inside the language model;
# LLaVA-NeXT: any-resolution tiles; InternVL: tiles; Gemma 3: image spans attended both ways (Ulysses only);
# DeepSeek-VL hybrid: two image inputs, each image at two resolutions, dealt together
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "llava_next", "internvl", "gemma3", "deepseek_vl_hybrid", *PLAIN_POSITIONS)
# Context parallelism in the default suite's launch: one family per path through the split (LLaVA-NeXT's tiles and
# HyperCLOVAX's plain positions split with -m slow, in the every-family launch below)
CONTEXT_PARALLEL = ("qwen2_5_vl", "qwen3_vl", "internvl", "deepseek_vl_hybrid")
# PaddleOCR-VL: unflattened patches, its projector looping over the rank's share of the images (2.6 s on 2 idle cores;
# GLM-OCR's images cross no chunk boundary on these rows: PATCH_FAMILIES, with -m slow)
FAMILIES += ("paddleocr_vl",)
CONTEXT_PARALLEL += ("paddleocr_vl",)
VISION_TOWER_NAMES = (".visual.", ".vision_tower.", ".vision_model.", ".image_tower.")  # Video-LLaVA: image_tower
# PaddleOCR-VL's projector calls its layers once per image: under ZeRO-3 (Ulysses' engine), which gathers their weights
# at each call, ranks encoding shares of different sizes would hang (a 4-rank row did), so dealing is refused there
# (test_images_dealt_under_zero3_are_refused_for_a_projector_that_loops_over_images) and every rank encodes all
WHOLE_IMAGES_UNDER_ZERO3 = ("paddleocr_vl",)
SHARED_UNDER_CONTEXT = ("qwen2_5_vl",)  # prefix sharing: each pair's prompt and images laid out once
WHOLE_IMAGES = "qwen3_vl"  # deal_images=False: every rank runs the vision tower on all of the row's images
PAIRS_PER_PROCESS = 2
STEPS = 3
IMAGES_PER_ROW = "3,2"
VISION_OPTIONS = ("--vision", "--images-per-row", IMAGES_PER_ROW, "--steps", str(STEPS), "--max-length", "1024")  # fmt: skip


def pairs() -> tuple[str, ...]:
    """The same dataset for every run (the sampler's order depends on its size), whole batches for up to 4 processes:
    one row of `PAIRS_PER_PROCESS` pairs per step, each step one of the row's ranks' micro-batches."""
    return ("--num-pairs", str(PAIRS_PER_PROCESS * 8), "--batch-size", str(PAIRS_PER_PROCESS))


@pytest.fixture(scope="module")
def vision_models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vision_models")
    save_vision_models(directory, FAMILIES)
    return directory


# Not distributed_runs.single_process_padded_fixture: this baseline also saves each run's first-step gradients
@pytest.fixture(scope="module")
def single_process_padded(vision_models, tmp_path_factory):
    """TRL's padded trainer, one process; each run's first-step gradients in `<dir>/<run>.pt`."""
    directory = tmp_path_factory.mktemp("single")
    runs = ",".join(f"{model_type}:trl" for model_type in FAMILIES)
    options = ("--runs", runs, *pairs(), *VISION_OPTIONS, "--save-grads", str(directory / "{run}.pt"))
    reports = train_in_this_process(vision_models, directory / "report.json", *options)
    return {
        model_type: reports[f"{model_type}:trl"] | {"grads": directory / f"{model_type}:trl.pt"}
        for model_type in FAMILIES
    }


@pytest.fixture(scope="module")
def context_parallel_runs(vision_models, tmp_path_factory):
    """Every CONTEXT_PARALLEL family in the same two processes (plain data parallelism otherwise); each run's
    first-step gradients, reduced over the row's ranks, in `<dir>/<run>.pt`."""
    directory = tmp_path_factory.mktemp("cp")
    runs = [f"{model_type}:padding_free+cp" for model_type in CONTEXT_PARALLEL]
    runs += [f"{model_type}:padding_free+cp+prefix_sharing" for model_type in SHARED_UNDER_CONTEXT]
    runs += [f"{WHOLE_IMAGES}:padding_free+cp+whole_images"]
    options = ("--runs", ",".join(runs), "--cp-size", "2", *pairs(), *VISION_OPTIONS)
    reports = launch("multi_gpu.yaml", vision_models, directory / "report.json", *options, "--save-grads",
                     str(directory / "{run}.pt"), "--count-collectives")  # fmt: skip
    return {run: reports[run] | {"grads": directory / f"{run}.pt"} for run in runs}


def assert_same_gradients(path, expected_path) -> None:
    """Every first-step gradient, the vision tower's included, within DISTRIBUTED_GRAD_ATOL of the largest."""
    grads, expected = torch.load(path), torch.load(expected_path)
    vision = [name for name in expected if any(part in name for part in VISION_TOWER_NAMES)]
    assert vision and all(expected[name].abs().max() > 0 for name in vision), "the vision tower got no gradient"
    # A parameter no forward used has no gradient in one process, and zeros gathered from ZeRO-3's partitions
    # (LLaVA's unused last vision layer): compared as zeros
    for name in grads.keys() | expected.keys():
        like = grads.get(name, expected.get(name))
        grads.setdefault(name, torch.zeros_like(like))
        expected.setdefault(name, torch.zeros_like(like))
    largest = max(grad.abs().max().item() for grad in expected.values())
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=DISTRIBUTED_GRAD_ATOL * max(1.0, largest), rtol=0, msg=name)


def assert_images_encoded(report: dict, model_type: str) -> None:
    """Dealt over the row's ranks, but under ZeRO-3 for a projector that loops over images (refused there: every rank
    encodes the whole row's images)."""
    if model_type in WHOLE_IMAGES_UNDER_ZERO3 and report.get("zero_stage") == 3:
        rows = report["vision_tower_rows"]
        assert rows["dealt"] == 0 and rows["whole"] > 0, rows
    else:
        assert_images_dealt(report)


def assert_images_dealt(report: dict) -> None:
    """Every training row's vision tower ran on each rank's share of its images (parallel/image_shares.py): the rows
    here hold more sequences with images than they have ranks."""
    rows = report["vision_tower_rows"]
    assert rows["dealt"] > 0 and rows["whole"] == 0, rows


@pytest.mark.parametrize("model_type", CONTEXT_PARALLEL)
def test_context_parallel_2_on_image_rows_equals_one_padded_process(
    context_parallel_runs, single_process_padded, model_type
):
    report = context_parallel_runs[f"{model_type}:padding_free+cp"]
    assert report["model_type"] == model_type and report["context_parallel_size"] == 2
    assert_split_row_training(report, single_process_padded[model_type])
    assert_same_gradients(report["grads"], single_process_padded[model_type]["grads"])
    assert report["images_split_across_ranks"] > 0, "no image crossed a chunk boundary: nothing was tested"
    assert_images_dealt(report)
    assert_no_object_collective(report)  # pixels and all handed out as tensors


def test_context_parallel_2_with_every_rank_encoding_every_image(context_parallel_runs, single_process_padded):
    # deal_images=False: the vision tower on all of the row's images on every rank, the other exact way
    report = context_parallel_runs[f"{WHOLE_IMAGES}:padding_free+cp+whole_images"]
    assert report["vision_tower_rows"]["dealt"] == 0 and report["vision_tower_rows"]["whole"] > 0
    assert_split_row_training(report, single_process_padded[WHOLE_IMAGES])
    assert_same_gradients(report["grads"], single_process_padded[WHOLE_IMAGES]["grads"])


def ulysses_run(model_type: str, run: str) -> str:
    return f"{run}+whole_images" if model_type in WHOLE_IMAGES_UNDER_ZERO3 else run


def launch_ulysses(vision_models, tmp_path_factory, model_type: str, run: str, processes: int = 2, *options) -> dict:
    """One run in its own `accelerate launch`: DeepSpeed sets sequence parallelism up once per process."""
    directory = tmp_path_factory.mktemp(f"{model_type}_{run}")
    output = directory / "report.json"
    # --save-grads turns gradient clipping off (train_dpo.py), as in the padded runs it is compared with
    arguments = ("--runs", f"{model_type}:{run}", "--sp-size", "2", *pairs(), *VISION_OPTIONS, *options,
                 "--save-grads", str(directory / "{run}.pt"))  # fmt: skip
    report = launch("zero3.yaml", vision_models, output, *arguments, processes=processes)[f"{model_type}:{run}"]
    return report | {"grads": directory / f"{model_type}:{run}.pt"}


# Each Ulysses run is a launch of its own: the default suite runs Gemma 3 (image spans attended both ways, which
# context parallelism refuses), `-m slow` the others (Qwen3-VL's deepstack features split by context in the default)
ULYSSES_DEFAULT = ("gemma3",)


@pytest.mark.parametrize(
    "model_type",
    [family if family in ULYSSES_DEFAULT else pytest.param(family, marks=pytest.mark.slow) for family in FAMILIES],
)
def test_ulysses_2_on_image_rows_equals_one_padded_process(
    vision_models, tmp_path_factory, single_process_padded, model_type
):
    report = launch_ulysses(vision_models, tmp_path_factory, model_type, ulysses_run(model_type, "padding_free+sp"))
    assert report["model_type"] == model_type and report["sequence_parallel_size"] == 2
    assert report["zero_stage"] == 3 and report["policy_sharded"]
    assert_split_row_training(report, single_process_padded[model_type])
    # ZeRO-3's partitioned gradients, gathered before its step (train_dpo.py, FirstStepGradients)
    assert_same_gradients(report["grads"], single_process_padded[model_type]["grads"])
    assert report["images_split_across_ranks"] > 0, "no image crossed a chunk boundary: nothing was tested"
    assert_images_encoded(report, model_type)


BOTH = ("qwen2_5_vl", "llava_next")


# 4 processes on 2 cores: with -m slow (Ulysses x context parallelism runs by default on text rows, test_context_parallel)
@pytest.mark.slow
@pytest.mark.parametrize("model_type", BOTH)
def test_ulysses_times_context_4_on_image_rows_equals_one_padded_process(
    vision_models, tmp_path_factory, single_process_padded, model_type
):
    report = launch_ulysses(vision_models, tmp_path_factory, model_type, "padding_free+cp+sp", 4, "--cp-size", "2")
    assert report["world_size"] == 4
    assert report["sequence_parallel_size"] == 2 and report["context_parallel_size"] == 2
    assert_split_row_training(report, single_process_padded[model_type])
    assert report["images_split_across_ranks"] > 0, "no image crossed a chunk boundary: nothing was tested"
    assert_images_dealt(report)


@pytest.mark.parametrize("model_type", SHARED_UNDER_CONTEXT)
def test_context_parallel_2_with_prefix_sharing_on_image_rows_equals_one_padded_process(
    context_parallel_runs, single_process_padded, model_type
):
    report = context_parallel_runs[f"{model_type}:padding_free+cp+prefix_sharing"]
    assert all(metrics["padfree/shared_tokens"] > 0 for metrics in report["metrics"])
    assert all(m["padfree/images_encoded"] < m["padfree/images_padded"] for m in report["metrics"])
    assert_split_row_training(report, single_process_padded[model_type])
    assert_same_gradients(report["grads"], single_process_padded[model_type]["grads"])
    assert_images_dealt(report)  # each pair's images once, in its chosen sequence: 2 sequences with images a row


def test_context_parallel_2_with_accumulation_and_a_row_whose_images_sit_on_one_rank(vision_models, tmp_path_factory):
    # Every other pair has an image, the rest none; with prefix sharing the row starts with the imaged pair's
    # prompt, laid out once, so its images sit in rank 0's chunk; two micro-batches accumulated per step
    directory = tmp_path_factory.mktemp("cp_accumulation")
    run = "qwen2_5_vl:padding_free+cp+prefix_sharing"
    options = (*pairs(), "--vision", "--images-per-row", "1,0", "--steps", "2", "--grad-accum", "2")
    single = train_in_this_process(vision_models, directory / "single.json", "--runs", "qwen2_5_vl:trl", *options)
    report = launch("multi_gpu.yaml", vision_models, directory / "cp.json", "--runs", run, "--cp-size", "2", *options)
    assert report[run]["rows_with_images_on_one_rank"] > 0, "every row had images on both ranks: nothing was tested"
    # one sequence with images to a row, for two ranks: each encodes it (image_shares.py deals none)
    assert report[run]["vision_tower_rows"]["whole"] > 0
    # (assert_split_row_training's token count is per micro-batch; here two make a step)
    assert report[run]["sequences_split_across_ranks"] > 0
    assert report[run]["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)
    assert_same_training(report[run], single["qwen2_5_vl:trl"])


# Under the sharding engines, the reference offloaded: ZeRO-3 (Qwen2.5-VL) and FSDP2 (InternVL, its LM head tied; the
# default suite's only context-parallel run under FSDP2)


@pytest.mark.parametrize(
    "config, model_type",
    [("zero3.yaml", "qwen2_5_vl"), ("fsdp2.yaml", "internvl")],
    ids=["zero3", "fsdp2"],
)
def test_context_parallel_2_on_image_rows_under_a_sharding_engine(
    vision_models, tmp_path_factory, single_process_padded, config, model_type
):
    directory = tmp_path_factory.mktemp(f"cp_{model_type}")
    run = f"{model_type}:padding_free+cp+ref_offload"
    options = (
        "--runs",
        run,
        "--cp-size",
        "2",
        *pairs(),
        *VISION_OPTIONS,
        "--save-grads",
        str(directory / "{run}.pt"),
    )
    report = launch(config, vision_models, directory / "report.json", *options)[run]
    if config.startswith("zero3"):
        assert report["zero_stage"] == 3 and report["policy_sharded"] and report["reference"]["offloaded"]
    else:
        assert report["policy_fsdp"]["sharded"] and report["reference_fsdp"]["cpu_offload"]
    # Each gradient gathered from its shards (FSDP2) or partitions (ZeRO-3, before the engine's step)
    assert_same_gradients(directory / f"{run}.pt", single_process_padded[model_type]["grads"])
    assert_split_row_training(report, single_process_padded[model_type])
    assert report["images_split_across_ranks"] > 0
    assert_images_dealt(report)  # every rank calls the sharded vision tower, on its share


# Every family tests/support/tiny_vision/ packs (`-m slow`): context parallelism in one launch, Ulysses and both together in
# a launch per family

# Refused, with the way out (refusals/): Gemma 3's image spans under context parallelism; Qwen3.5's gated delta-net
# layers (MiniCPM-V's language model is Qwen3.5's) and LFM3-VL's short convolutions carry state along the row, which a
# chunk would cut; a MoE router loss over a split row (as for text models)
SPLIT_FAMILIES = tuple(
    family for family in VISION_FAMILIES if family not in (*MOE_FAMILIES, "qwen3_5", "lfm3_vl", *MINICPM_FAMILIES)
)
REFUSED_UNDER_CONTEXT = ("gemma3", "shieldgemma2", "gemma4_unified")  # images attended both ways
# DeepSpeed's Ulysses exchanges every layer at one head dim, the config's: Gemma 4's global layers are twice as wide
# (its setup failed reading the per-layer `head_dim`), Kimi K2.5's latent attention has a query wider than its
# config's `head_dim` (the rope part); context parallelism splits them
REFUSED_UNDER_ULYSSES = ("gemma4", "gemma4_unified", "kimi_k25")
# Granite 4 Vision does not load under ZeRO-3's zero.Init, which Ulysses runs under: transformers 5.24's _init_weights
# divides by a partitioned parameter's empty shape (ZeroDivisionError); TRL's padded trainer fails the same way
NOT_UNDER_ZERO3 = ("granite4_vision",)


def padded_families(name: str, families, run: str = "trl"):
    """A module fixture `name`: `families`' models (and their processors, where they save) in one folder, with one
    padded process's training on each (`run`), its first-step gradients in `<dir>/<family>:<run>.pt`."""

    @pytest.fixture(scope="module", name=name)
    def trained(tmp_path_factory):
        directory = tmp_path_factory.mktemp(name)
        save_vision_models(directory, families)
        runs = ",".join(f"{model_type}:{run}" for model_type in families)
        reports = train_in_this_process(directory, directory / "single.json", "--runs", runs, *pairs(), *VISION_OPTIONS,
                                        "--save-grads", str(directory / "{run}.pt"))  # fmt: skip
        return directory, {model_type: reports[f"{model_type}:{run}"] for model_type in families}

    return trained


every_family = padded_families("every_family", SPLIT_FAMILIES)


@pytest.mark.slow
def test_context_parallel_2_on_every_family_with_and_without_prefix_sharing(every_family):
    directory, single = every_family
    families = [family for family in SPLIT_FAMILIES if family not in REFUSED_UNDER_CONTEXT]
    runs = [f"{model_type}:padding_free+cp{sharing}" for model_type in families for sharing in ("", "+prefix_sharing")]
    reports = launch("multi_gpu.yaml", directory, directory / "cp.json", "--runs", ",".join(runs), "--cp-size", "2",
                     *pairs(), *VISION_OPTIONS, "--save-grads", str(directory / "{run}.pt"))  # fmt: skip
    for run in runs:
        model_type = run.split(":")[0]
        assert_split_row_training(
            reports[run],
            single[model_type],
            DISTRIBUTED_METRIC_RTOL_BY_FAMILY.get(model_type, DISTRIBUTED_METRIC_RTOL),
        )
        assert_same_gradients(directory / f"{run}.pt", directory / f"{model_type}:trl.pt")
        assert_images_dealt(reports[run])


@pytest.mark.parametrize("model_type", REFUSED_UNDER_ULYSSES)
def test_ulysses_refuses_head_dims_it_cannot_exchange_with_the_way_out(model_type):
    processor = make_vision_processor(model_type)
    with pytest.raises(ValueError, match="exchanges every attention layer's query, key and value at one head size"):
        check_ulysses_model(make_vision_config(model_type, processor), ATTN_IMPLEMENTATION, 2, EXACT_UNDER_ULYSSES)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type", [family for family in SPLIT_FAMILIES if family not in REFUSED_UNDER_ULYSSES + NOT_UNDER_ZERO3]
)
def test_ulysses_2_and_ulysses_times_context_4_on_every_family(every_family, tmp_path_factory, model_type):
    directory, single = every_family
    report = launch_ulysses(directory, tmp_path_factory, model_type, ulysses_run(model_type, "padding_free+sp"))
    assert_split_row_training(report, single[model_type])
    assert_same_gradients(report["grads"], directory / f"{model_type}:trl.pt")
    assert_images_encoded(report, model_type)
    if model_type not in REFUSED_UNDER_CONTEXT:
        run = ulysses_run(model_type, "padding_free+cp+sp")
        report = launch_ulysses(directory, tmp_path_factory, model_type, run, 4, "--cp-size", "2")
        assert_split_row_training(report, single[model_type])
        assert_images_encoded(report, model_type)


MOE_WITHOUT_ROUTER_LOSS = ("qwen3_vl_moe", "glm4v_moe")  # a router loss over a split row is refused; without it


# Qwen3-VL-MoE's checkpoint in the hub's layout (tiny_vision.save_experts_in_hub_layout), which DeepSpeed's zero.Init
# loads; trained without the router loss
moe_families = padded_families("moe_families", MOE_WITHOUT_ROUTER_LOSS, run="trl+no_aux")


@pytest.mark.slow
def test_moe_families_without_their_router_loss_split_by_context(moe_families):
    directory, single = moe_families
    runs = ",".join(f"{model_type}:padding_free+cp+no_aux" for model_type in MOE_WITHOUT_ROUTER_LOSS)
    split = launch("multi_gpu.yaml", directory, directory / "cp.json", "--runs", runs, "--cp-size", "2", *pairs(),
                   *VISION_OPTIONS, "--save-grads", str(directory / "{run}.pt"))  # fmt: skip
    for model_type in MOE_WITHOUT_ROUTER_LOSS:
        run = f"{model_type}:padding_free+cp+no_aux"
        assert_split_row_training(split[run], single[model_type])
        assert_same_gradients(directory / f"{run}.pt", directory / f"{model_type}:trl+no_aux.pt")
        assert_images_dealt(split[run])


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MOE_WITHOUT_ROUTER_LOSS)
def test_moe_families_without_their_router_loss_under_ulysses_and_ulysses_times_context(
    moe_families, tmp_path_factory, model_type
):
    directory, single = moe_families
    report = launch_ulysses(directory, tmp_path_factory, model_type, "padding_free+sp+no_aux")
    assert report["zero_stage"] == 3 and report["policy_sharded"]
    assert_split_row_training(report, single[model_type])
    assert_same_gradients(report["grads"], directory / f"{model_type}:trl+no_aux.pt")
    assert_images_dealt(report)
    report = launch_ulysses(directory, tmp_path_factory, model_type, "padding_free+cp+sp+no_aux", 4, "--cp-size", "2")
    assert_split_row_training(report, single[model_type])
    assert_images_dealt(report)


# Image patches, `-m slow` (84 s for the six on 2 cores, most of it their single-process padded runs): GLM-OCR and
# GLMGA (GLM-4V's position function over the whole row), PaddleOCR-VL (each patch (3, 14, 14)), Kimi K2.5 (DeepSeek-V3's
# latent attention, plain positions), Cosmos3 Edge (its own position function), EXAONE 4.5 (plain positions); each
# family's images dealt over the ranks, with and without prefix sharing
PATCH_FAMILIES = ("glm_ocr", "paddleocr_vl", "kimi_k25", "glmga", "cosmos3_edge", "exaone4_5")
# whose images cross a chunk boundary on these rows: GLM-OCR's and GLMGA's (their processor's 1 to 12 tokens) each fall
# inside one chunk (measured), which leaves their rows' sequences split and their position function run over the row
CROSSING_PATCH_FAMILIES = ("paddleocr_vl", "kimi_k25", "cosmos3_edge", "exaone4_5")


patch_families = padded_families("patch_families", PATCH_FAMILIES)


@pytest.mark.slow
def test_context_parallel_2_on_image_patches_with_and_without_prefix_sharing(patch_families):
    directory, single = patch_families
    runs = [
        f"{model_type}:padding_free+cp{sharing}"
        for model_type in PATCH_FAMILIES
        for sharing in ("", "+prefix_sharing")
    ]
    reports = launch("multi_gpu.yaml", directory, directory / "cp.json", "--runs", ",".join(runs), "--cp-size", "2",
                     *pairs(), *VISION_OPTIONS, "--save-grads", str(directory / "{run}.pt"))  # fmt: skip
    for run in runs:
        model_type = run.split(":")[0]
        assert reports[run]["context_parallel_size"] == 2
        assert_split_row_training(reports[run], single[model_type])
        assert_same_gradients(directory / f"{run}.pt", directory / f"{model_type}:trl.pt")
        if model_type in CROSSING_PATCH_FAMILIES and "prefix_sharing" not in run:
            assert reports[run]["images_split_across_ranks"] > 0, f"{run}: no image crossed a chunk boundary"
        assert_images_dealt(reports[run])
