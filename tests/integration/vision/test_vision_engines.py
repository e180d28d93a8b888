"""Vision-language models under DeepSpeed ZeRO-3 (reference offloaded) and FSDP2, for real: tiny models saved like
checkpoints, trained padding-free on pairs with images by two CPU processes over gloo (`accelerate launch`,
tests/support/distributed/train_dpo.py --vision), compared step by step with TRL's padded trainer in one process on the same
global batches (tolerances.DISTRIBUTED_*, grad_norm included). Every family gets prompts with one and with two
images.

    ZeRO-3, default suite   Gemma 3 (and prefix sharing), Idefics3, InternVL, DeepSeek-VL hybrid (each image handed
                            over twice, at two resolutions), GLM-OCR (patches)
    FSDP2, default suite    Gemma 3 (and prefix sharing, reference offloaded), InternVL (tiles), PaddleOCR-VL
                            (patches; why not ZeRO-3: FSDP2_PATCH_FAMILIES); Idefics3 refused (last test)
    ZeRO-3, -m slow         MORE_ZERO3_FAMILIES (Aya Vision among them) and Qwen3-Omni's thinker (its router's aux
                            loss on: AUX_LOSS_ZERO3_FAMILIES), one launch
    FSDP2, -m slow          Aya Vision, its layers named
    ZeRO-2 or FSDP2         the families whose forward loops over images, which ZeRO-3 refuses (MiniCPM-V, LFM3-VL,
                            HY-V4-VL: tests/integration/vision/test_vision_engines_per_image_loops.py)
    not under ZeRO-3        Granite 4 Vision (NO_ZERO3_RUN says why; ZeRO-2, in the file above)

Gemma 3, InternVL and Aya Vision tie their LM heads to the input embeddings, Idefics3 does not; InternVL and Aya Vision
cut images into tiles.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

from distributed_runs import (  # noqa: E402
    ROOT,
    assert_same_training,
    checkout_environment,
    free_port,
    launch,
    save_vision_families,
    single_process_padded_fixture,
    train_padded_in_this_process,
)
from tolerances import FIRST_LOSS_ATOL  # noqa: E402
from transformers import AutoConfig, AutoModelForImageTextToText  # noqa: E402

from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION  # noqa: E402
from trl_padfree.modeling.check.packability import architecture_verdict  # noqa: E402

VERDICT_UNDER_ZERO3_INIT = ROOT / "tests" / "support" / "distributed" / "verdict_under_zero3_init.py"

# Under ZeRO-3 alone (as MORE_ZERO3_FAMILIES, below). Not the families whose forward loops over images (LFM3-VL's
# tower convolutions, MiniCPM-V's merger, PaddleOCR-VL's projector): ZeRO-3 refuses them (VisionFamily.per_image_loop)
# DeepSeek-VL hybrid: two image inputs per image (its SAM tower's high-resolution copy), DeepSeek-VL's path and more
ZERO3_ONLY = ("deepseek_vl_hybrid",)

FAMILIES = ("gemma3", "idefics3", "internvl", *ZERO3_ONLY)
# Image patches: GLM-OCR under ZeRO-3 (GLM-4V's position function), PaddleOCR-VL under FSDP2 in InternVL's processes
# (each patch (3, 14, 14)); each adds ~3 s to the default suite on 2 idle cores (its padded run and its run here).
# PaddleOCR-VL's projector runs once per image (a Python loop), so under ZeRO-3 each rank gathers its weights once per
# image: ranks holding different numbers of images issue different collectives and abort (gloo "collective mismatch"),
# TRL's padded trainer as well (measured, transformers 5.24), and trl-padfree refuses it; FSDP2 gathers the projector
# once per forward
ZERO3_PATCH_FAMILIES = ("glm_ocr",)
FSDP2_PATCH_FAMILIES = ("paddleocr_vl",)
FAMILIES += ZERO3_PATCH_FAMILIES
MODELS = FAMILIES + FSDP2_PATCH_FAMILIES  # every family saved and trained padded in one process
# In a launch of their own (-m slow: the default suite's time): Gemma 4 (images of any size with per-patch positions),
# ShieldGemma 2 (Gemma 3's classes), Kimi K2.5 (DeepSeek-V3's experts; test_kimi_k25_verdict_under_zero3_init below),
# DeepSeek-VL, Janus (their SigLIP towers, a token per patch), Ovis 2 (tiles), the patch families, Gemma 4 Unified
# (no vision tower), Aria (queries per image), Qwen2.5-Omni's thinker, and GOT-OCR2 and PP-Chart2Table (SAM over
# tiles, eager: their model has no sdpa)
MORE_ZERO3_FAMILIES = (
    "gemma4", "shieldgemma2", "cosmos3_omni", "hyperclovax_vision_v2", "video_llava", "qianfan_ocr", "kimi_k25",
    "deepseek_vl", "ovis2", "janus", "glmga", "cosmos3_edge", "exaone4_5", "gemma4_unified", "aria",
    "qwen2_5_omni_thinker", "got_ocr2", "pp_chart2table", "aya_vision",
)  # fmt: skip
# Families with no ZeRO-3 run here (transformers 5.24, DeepSpeed 0.19.8, 2 CPU processes):
# - Granite 4 Vision fails to load: its `_init_weights` divides by the size of a ZeRO-3 parameter that is partitioned
#   (empty) while transformers loads the checkpoint (ZeroDivisionError); TRL's padded trainer fails the same way
#   (measured). FSDP2 refuses its untied LM head (the last test); it trains under ZeRO-2
#   (tests/integration/vision/test_vision_engines_per_image_loops.py)
NO_ZERO3_RUN = ("granite4_vision",)
# Trained with MORE_ZERO3_FAMILIES: Qwen3-Omni's thinker, a Mixture-of-Experts whose config turns TRL's router aux loss
# on (router_aux_loss_coef 0.001), so its first loss is ln 2 plus 0.001 x the load-balancing loss (~2.005): 0.6952,
# whatever the engine (TRL's padded trainer in one process, over DDP, ZeRO-2 and ZeRO-3 alike, measured). The policy
# and the offloaded reference load equal (every parameter and buffer gathered under zero.Init, measured)
AUX_LOSS_ZERO3_FAMILIES = ("qwen3_omni_moe_thinker",)
SLOW_ZERO3_FAMILIES = (*MORE_ZERO3_FAMILIES, *AUX_LOSS_ZERO3_FAMILIES)
TILE_FAMILIES = ("internvl",)
PAIRS_PER_PROCESS = 2
STEPS = 3
# Every example of the 2 x 2 x 3 pairs the runs see, cycled: one image, two images in one prompt, one, one
IMAGES_PER_ROW = "1,2,1,1"
# A run stuck in mismatched collectives fails with every process's stack after this long, not at launch's 600 s
WATCHDOG_SECONDS = 120
VISION_OPTIONS = (
    "--vision", "--images-per-row", IMAGES_PER_ROW, "--num-pairs", str(2 * PAIRS_PER_PROCESS * STEPS),
    "--steps", str(STEPS),
)  # fmt: skip
# Gemma 3's `_no_split_modules` names SigLIP classes its vision tower does not have (the text embeddings and the
# pooling head of SigLIP; Gemma 3 uses neither), so accelerate's TRANSFORMER_BASED_WRAP raises "Could not find the
# transformer layer class SiglipTextEmbeddings in the model". A Gemma 3 user names the layers, as here (accelerate
# reads the config's `fsdp_transformer_layer_cls_to_wrap` from this variable)
GEMMA3_LAYERS_TO_WRAP = {"FSDP_TRANSFORMER_CLS_TO_WRAP": "Gemma3DecoderLayer,SiglipEncoderLayer"}

ZERO3_RUNS = {
    "gemma3": "gemma3:padding_free+ref_offload",
    "gemma3_prefix_sharing": "gemma3:padding_free+ref_offload+prefix_sharing",
    "idefics3": "idefics3:padding_free+ref_offload",
    "internvl": "internvl:padding_free+ref_offload",
    **{model_type: f"{model_type}:padding_free+ref_offload" for model_type in ZERO3_ONLY},
}
ZERO3_RUNS |= {model_type: f"{model_type}:padding_free+ref_offload" for model_type in ZERO3_PATCH_FAMILIES}
FSDP2_GEMMA3_RUNS = {
    "gemma3": "gemma3:padding_free",
    "gemma3_ref_offload_prefix_sharing": "gemma3:padding_free+ref_offload+prefix_sharing",
}


@pytest.fixture(scope="module")
def vision_models(tmp_path_factory):
    return save_vision_families(tmp_path_factory, "vision_models", MODELS)


single_process_padded = single_process_padded_fixture(
    {family: f"{family}:trl" for family in MODELS},
    *("--batch-size", str(2 * PAIRS_PER_PROCESS), *VISION_OPTIONS),
    models="vision_models",
)


def launch_runs(config: str, vision_models, output, runs: dict[str, str]) -> dict:
    options = ("--runs", ",".join(runs.values()), "--batch-size", str(PAIRS_PER_PROCESS), *VISION_OPTIONS)
    reports = launch(config, vision_models, output, *options, "--watchdog", str(WATCHDOG_SECONDS))
    return {name: reports[run] for name, run in runs.items()}


@pytest.fixture(scope="module")
def zero3_runs(vision_models, tmp_path_factory):
    """Every run of ZERO3_RUNS, one after the other, in the same two DeepSpeed ZeRO-3 processes."""
    output = tmp_path_factory.mktemp("zero3") / "report.json"
    return launch_runs("zero3.yaml", vision_models, output, ZERO3_RUNS)


@pytest.fixture(scope="module")
def fsdp2_runs(vision_models, tmp_path_factory):
    """The runs of FSDP2_GEMMA3_RUNS, in the same two FSDP2 processes."""
    with pytest.MonkeyPatch.context() as environment:
        for name, value in GEMMA3_LAYERS_TO_WRAP.items():
            environment.setenv(name, value)
        output = tmp_path_factory.mktemp("fsdp2_gemma3") / "report.json"
        return launch_runs("fsdp2.yaml", vision_models, output, FSDP2_GEMMA3_RUNS)


@pytest.fixture(scope="module")
def fsdp2_tile_runs(vision_models, tmp_path_factory):
    """InternVL and PaddleOCR-VL, padding-free, in two FSDP2 processes."""
    output = tmp_path_factory.mktemp("fsdp2_tiles") / "report.json"
    runs = {model_type: f"{model_type}:padding_free" for model_type in TILE_FAMILIES + FSDP2_PATCH_FAMILIES}
    return launch_runs("fsdp2.yaml", vision_models, output, runs)


def assert_images_packed(report: dict, shared_prefix: bool = False) -> None:
    """Every step packed images: each sequence's (TRL hands each pair's images over twice), or with a shared prefix
    each pair's once."""
    for metrics in report["metrics"]:
        assert metrics["padfree/images_padded"] > 0
        expected = metrics["padfree/images_padded"] / (2 if shared_prefix else 1)
        assert metrics["padfree/images_encoded"] == pytest.approx(expected)


# DeepSpeed ZeRO-3, the reference's parameters offloaded to CPU memory


def first_loss_of_a_policy_equal_to_its_reference(report: dict, model_dir) -> float:
    """ln 2; where the model's config turns TRL's router aux loss on, plus its coefficient times the policy's
    load-balancing loss (each process's, averaged as the loss is), which the reference's log-probs do not cancel."""
    if not report["aux_loss_enabled"]:
        return math.log(2)
    coef = AutoConfig.from_pretrained(model_dir).get_text_config().router_aux_loss_coef
    return math.log(2) + coef * report["metrics"][0]["aux_loss"]


def assert_zero3_ref_offload_run(report: dict, padded: dict, model_type: str, models_dir) -> None:
    assert report["model_type"] == model_type
    assert report["world_size"] == 2 and report["zero_stage"] == 3 and report["policy_sharded"]
    assert report["reference"] == {"kept": True, "offloaded": True}
    first_loss = first_loss_of_a_policy_equal_to_its_reference(report, models_dir / model_type)
    assert report["losses"][0] == pytest.approx(first_loss, abs=FIRST_LOSS_ATOL)
    assert len(report["losses"]) == STEPS
    assert_same_training(report, padded)
    assert_images_packed(report)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_zero3_ref_offload_padding_free_with_images_matches_single_process_padded_trl(
    vision_models, zero3_runs, single_process_padded, model_type
):
    assert_zero3_ref_offload_run(zero3_runs[model_type], single_process_padded[model_type], model_type, vision_models)


@pytest.fixture(scope="module")
def more_vision_models(tmp_path_factory):
    return save_vision_families(tmp_path_factory, "more_vision_models", SLOW_ZERO3_FAMILIES)


@pytest.fixture(scope="module")
def more_zero3_runs(more_vision_models, tmp_path_factory):
    """SLOW_ZERO3_FAMILIES trained padded in one process, then padding-free in two ZeRO-3 processes (the reference
    offloaded): (runs, padded) by family."""
    pairs_per_step = 2 * PAIRS_PER_PROCESS
    padded = train_padded_in_this_process(
        more_vision_models, tmp_path_factory, SLOW_ZERO3_FAMILIES, pairs_per_step, *VISION_OPTIONS
    )
    runs = {model_type: f"{model_type}:padding_free+ref_offload" for model_type in SLOW_ZERO3_FAMILIES}
    output = tmp_path_factory.mktemp("more_zero3") / "report.json"
    return launch_runs("zero3.yaml", more_vision_models, output, runs), padded


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SLOW_ZERO3_FAMILIES)
def test_more_families_under_zero3_ref_offload_match_single_process_padded_trl(
    more_vision_models, more_zero3_runs, model_type
):
    reports, padded = more_zero3_runs
    assert reports[model_type]["aux_loss_enabled"] == (model_type in AUX_LOSS_ZERO3_FAMILIES)
    # The load-balancing loss is not a mean over pairs: one process's step of 4 pairs differs from the mean of two
    # processes' 2 (Qwen3-Omni: aux_loss up to 1.3e-3 apart, the loss 1.1e-6, within the bounds), so it is not compared
    assert_zero3_ref_offload_run(reports[model_type], padded[model_type], model_type, more_vision_models)


@pytest.mark.slow
def test_kimi_k25_verdict_under_zero3_init_equals_its_verdict_without(more_vision_models):
    # DeepSpeed's zero.Init puts back, on exit, the `__init__` it saw when a class was created inside it: DeepSeek-V3's
    # experts, first imported there when Kimi K2.5 builds its language model, lose what transformers' decorator adds
    # (`self.config`), and the twin built after fails. The trainer imports the modules first under ZeRO-3
    # (integrations/transformers.py's `modeling_modules_imported`); each verdict in a fresh interpreter, as a process
    # of a launch starts
    model_dir = more_vision_models / "kimi_k25"
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    without = architecture_verdict(model, ATTN_IMPLEMENTATION, images=True)

    def under_zero3_init(*flags: str) -> dict:
        script = (VERDICT_UNDER_ZERO3_INIT, model_dir, ATTN_IMPLEMENTATION, free_port(), *flags)
        command = [sys.executable, *map(str, script)]
        result = subprocess.run(command, capture_output=True, text=True, env=checkout_environment(), timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.splitlines()[-1])

    assert without.exact
    assert under_zero3_init("--import-first") == {"exact": without.exact, "reason": without.reason}
    # What the trainer's import prevents, as DeepSpeed 0.19.8 does it: the test would pass without it otherwise
    assert "'DeepseekV3Experts' object has no attribute 'config'" in under_zero3_init()["reason"]


def test_prefix_sharing_with_images_under_zero3_ref_offload_matches_single_process_padded_trl(
    zero3_runs, single_process_padded
):
    report = zero3_runs["gemma3_prefix_sharing"]
    assert report["policy_sharded"] and report["reference"] == {"kept": True, "offloaded": True}
    assert_same_training(report, single_process_padded["gemma3"])
    assert all(metrics["padfree/shared_tokens"] > 0 for metrics in report["metrics"])
    assert_images_packed(report, shared_prefix=True)


# FSDP2


def assert_fsdp2_sharded(report: dict) -> None:
    assert report["world_size"] == 2 and report["fsdp_version"] == 2
    assert report["policy_fsdp"]["sharded"], "the policy's parameters are not DTensor shards: FSDP2 did not run"
    assert report["reference_fsdp"]["sharded"] and report["reference_fsdp"]["units"] > 1  # trl-padfree's, by layer


def test_fsdp2_padding_free_with_images_matches_single_process_padded_trl(fsdp2_runs, single_process_padded):
    report = fsdp2_runs["gemma3"]
    assert_fsdp2_sharded(report)
    assert not report["reference_fsdp"]["cpu_offload"]
    assert report["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)
    assert len(report["losses"]) == STEPS
    assert_same_training(report, single_process_padded["gemma3"])
    assert_images_packed(report)


def test_prefix_sharing_with_images_under_fsdp2_ref_offload_matches_single_process_padded_trl(
    fsdp2_runs, single_process_padded
):
    report = fsdp2_runs["gemma3_ref_offload_prefix_sharing"]
    assert_fsdp2_sharded(report)
    assert report["reference_fsdp"]["cpu_offload"]
    assert_same_training(report, single_process_padded["gemma3"])
    assert all(metrics["padfree/shared_tokens"] > 0 for metrics in report["metrics"])
    assert_images_packed(report, shared_prefix=True)


@pytest.mark.parametrize("model_type", TILE_FAMILIES + FSDP2_PATCH_FAMILIES)
def test_fsdp2_padding_free_with_image_tiles_or_patches_matches_single_process_padded_trl(
    fsdp2_tile_runs, single_process_padded, model_type
):
    report = fsdp2_tile_runs[model_type]
    assert report["model_type"] == model_type
    assert_fsdp2_sharded(report)
    assert report["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)
    assert len(report["losses"]) == STEPS
    assert_same_training(report, single_process_padded[model_type])
    assert_images_packed(report)


# Aya Vision's SigLIP tower has Gemma 3's `_no_split_modules` problem, so its layers are named (-m slow: the default
# suite names Gemma 3's)
@pytest.mark.slow
def test_fsdp2_aya_vision_with_its_layers_named_matches_single_process_padded_trl(
    more_vision_models, more_zero3_runs, tmp_path
):
    _, padded = more_zero3_runs
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Cohere2DecoderLayer,SiglipEncoderLayer")
        report = launch_runs(
            "fsdp2.yaml", more_vision_models, tmp_path / "report.json", {"aya_vision": "aya_vision:padding_free"}
        )["aya_vision"]
    assert_fsdp2_sharded(report)
    assert report["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)
    assert_same_training(report, padded["aya_vision"])
    assert_images_packed(report)


def test_fsdp2_on_a_vision_language_model_with_an_untied_lm_head_is_refused(vision_models, tmp_path):
    # accelerate 1.15 shards a VLM's untied lm_head as an FSDP2 unit of its own (it finds no final norm among
    # model.model's children, the towers), and TRL 1.16's fused LM head reads lm_head.weight without calling lm_head:
    # the unit never gathers and its gradient is not reduced over the processes. Measured before this refusal:
    # lm_head's gradient 0.089 off one process, TRL's own padded trainer under FSDP2 as wrong, every other gradient
    # within 1e-6. ZeRO-3 (above) trains Idefics3 equal to one process.
    with pytest.raises(AssertionError, match="FSDP2 would train this vision-language model's LM head wrong"):
        launch_runs("fsdp2.yaml", vision_models, tmp_path / "report.json", {"idefics3": "idefics3:padding_free"})
