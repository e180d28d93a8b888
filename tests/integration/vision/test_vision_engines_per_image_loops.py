"""Vision-language families whose forward runs a module's layers once per image or crop, a Python loop
(modeling/families/, `VisionFamily.per_image_loop`): PaddleOCR-VL's projector and HY-V4-VL's patch merger per image,
MiniCPM-V's merger per crop (4.6, 4.7 and OCR), LFM3-VL's tower convolutions per image.

Why they are apart from tests/integration/vision/test_vision_engines.py: DeepSpeed ZeRO-3 gathers a layer's weights at each of its calls
and checks that every process called its modules in the same order, so processes whose rows hold different numbers of
images or crops issue different collectives. On 2 data-parallel CPU processes gloo aborts ("collective mismatch"),
TRL's padded trainer as well (measured for PaddleOCR-VL, the three MiniCPM-V and LFM3-VL, transformers 5.24, DeepSpeed
0.19.8); on GPUs NCCL would hang. So does one row split over 4 processes that deal its images (PaddleOCR-VL, sequence
times context parallelism: shares of 3 and 2 images, a hang). trl-padfree refuses both at trainer construction
(refusals.parallel.check_zero3_per_image_loop). DeepSpeed's remedy for modules called a data-dependent number of
times, leaf modules (`zero_optimization.leaf_module`: the module's weights gathered once, its layers not hooked), does
not make it work (measured): MiniCPM-V's merger returns a list, so the backward hook that reduces a leaf's gradients
never fires and they are left unreduced (on CPU `zero_grad` then fails on them); LFM3-VL's convolution block fails in
its backward, its weights released before their gradients are accumulated.

What is tested here: the modules that run a data-dependent number of times on each tiny family, against the table;
the refusal and its way out; and the ways out trained for real, two CPU processes over gloo (`accelerate launch`,
tests/support/distributed/train_dpo.py --vision) against TRL's padded trainer in one process on the same global batches
(tolerances.DISTRIBUTED_*, grad_norm included): FSDP2, which gathers a module once per forward with the unit
holding it, for MiniCPM-OCR and LFM3-VL (PaddleOCR-VL's is tests/integration/vision/test_vision_engines.py's); ZeRO-2, which gathers
nothing, for MiniCPM-V 4.6 and 4.7, whose untied LM heads FSDP2 refuses; and ZeRO-3 with Ulysses over one row whose
processes each encode all of its images (`deal_images=False`), for PaddleOCR-VL.
"""

from __future__ import annotations

import collections
import fnmatch
import math
from types import SimpleNamespace

import pytest
import torch

from trl_padfree.modeling.vision import per_image_loop
from trl_padfree.refusals.parallel import check_zero3_per_image_loop

pytest.importorskip("deepspeed")

from distributed_runs import (  # noqa: E402
    assert_same_training,
    assert_split_row_training,
    launch,
    save_vision_families,
    single_process_padded_fixture,
    train_in_this_process,
)
from tiny_vision import (  # noqa: E402
    EAGER_FAMILIES,
    VISION_FAMILIES,
    make_vision_model,
    make_vision_processor,
    save_vision_models,
    vision_preference_rows,
)
from tolerances import FIRST_LOSS_ATOL  # noqa: E402

# The ways out, each run padding-free on 2 processes: FSDP2 where the LM head is tied (each family's layers named, as
# a user names them where `_no_split_modules` lists a class the model lacks: MiniCPM's names Qwen3.5's vision block)
FSDP2_LAYERS = {
    "minicpm_ocr": "Qwen3_5DecoderLayer,MiniCPMOcrVisionEncoderLayer",
    "lfm3_vl": "Lfm3DecoderLayer,Lfm3VlVisionLayer",
}
ZERO2_FAMILIES = ("minicpmv4_6", "minicpmv4_7", *EAGER_FAMILIES)  # untied LM heads (HY-V4-VL: transformers 5.24)
# and Granite 4 Vision's untied head, which loops over nothing but which transformers 5.24 cannot load under ZeRO-3
# (test_vision_engines.NO_ZERO3_RUN)
ZERO2_FAMILIES += ("granite4_vision",)
MODELS = (*FSDP2_LAYERS, *ZERO2_FAMILIES)
PAIRS_PER_PROCESS = 2
STEPS = 3
# Every example of the 2 x 2 x 3 pairs the runs see, cycled: one image, two images in one prompt, one, one; the
# processes' rows hold different numbers of images (and of MiniCPM's crops), as under ZeRO-3 they must not
IMAGES_PER_ROW = "1,2,1,1"
# A launch stuck in mismatched collectives fails with every process's stack after this long, not at launch's 600 s
# (launches only: in this process the watchdog would end pytest itself)
WATCHDOG = ("--watchdog", "120")
VISION_OPTIONS = (
    "--vision", "--images-per-row", IMAGES_PER_ROW, "--num-pairs", str(2 * PAIRS_PER_PROCESS * STEPS),
    "--steps", str(STEPS),
)  # fmt: skip


# The refusal, in this process


def model_of(model_type: str) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(model_type=model_type))


def test_zero3_refuses_a_per_image_loop_where_processes_run_different_images_naming_the_way_out():
    loop = per_image_loop(model_of("minicpmv4_6"))
    assert loop == ("model.merger", "crop")
    # Data parallelism: the processes' rows differ
    with pytest.raises(ValueError, match=r"ZeRO-3 cannot train MiniCPMV4_6ForConditionalGeneration on images over .*"
                       r"`model\.merger` runs its layers once per crop.*padded trainer.*fails the same way.*"
                       r"ZeRO-2 \(`trl-padfree dpo --accelerate_config zero2`\).*FSDP2 is refused"):  # fmt: skip
        check_zero3_per_image_loop("MiniCPMV4_6ForConditionalGeneration", loop, 3, 2, 1, tied_lm_head=False)
    lfm3_loop = per_image_loop(model_of("lfm3_vl"))
    with pytest.raises(ValueError, match=r"once per image.*Train it with FSDP2 \(`trl-padfree dpo --accelerate_config "
                       r"fsdp2`\).*or DeepSpeed ZeRO-2"):  # fmt: skip
        check_zero3_per_image_loop("Lfm3VlForConditionalGeneration", lfm3_loop, 3, 4, 1, tied_lm_head=True)
    # One row over every process, its images dealt: the shares can hold different numbers (PaddleOCR-VL's row over
    # 4 CPU processes, 2 of them given 3 images and 2 given 2, hung in the first step that dealt them)
    loop = per_image_loop(model_of("paddleocr_vl"))
    with pytest.raises(ValueError, match=r"cannot deal PaddleOCRVLForConditionalGeneration's images over the 4 "
                       r"processes of a row: its `model\.projector` runs its layers once per image.*"
                       r"Set deal_images=False"):  # fmt: skip
        check_zero3_per_image_loop("PaddleOCRVLForConditionalGeneration", loop, 3, 1, 4, tied_lm_head=True)
    # Not refused: ZeRO-2; one row over every process, each encoding all of its images; a family without a loop
    check_zero3_per_image_loop("X", loop, 2, 2, 2, tied_lm_head=False)
    check_zero3_per_image_loop("X", loop, 3, 1, 1, tied_lm_head=False)
    check_zero3_per_image_loop("X", per_image_loop(model_of("gemma4_unified")), 3, 2, 2, tied_lm_head=True)


# The table, against the modules each tiny family really runs a data-dependent number of times


def forward_calls(model: torch.nn.Module, batch: dict) -> collections.Counter:
    """Each module's forward calls (what ZeRO-3 hooks) in one forward of `batch`."""
    calls = collections.Counter()
    hooks = [
        module.register_forward_pre_hook(lambda module, args, name=name: calls.update([name]))
        for name, module in model.named_modules()
    ]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


@pytest.mark.slow  # 55 s for the 42 families on 2 cores
@pytest.mark.parametrize("model_type", VISION_FAMILIES + EAGER_FAMILIES)
def test_the_modules_run_once_per_image_are_those_the_family_table_names(model_type):
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    processor = make_vision_processor(model_type)
    model = make_vision_model(model_type, processor).eval()
    collator = DataCollatorForVisionPreference(processor)
    counts = []
    for images_per_row in ([1, 1], [2, 1]):  # TRL's padded batch of 2 pairs: 2 images each way, then 3
        batch = collator(vision_preference_rows(model_type, 2, images_per_row=images_per_row))
        batch.pop("completion_mask")
        counts.append(forward_calls(model, batch))
    varying = sorted(name for name in counts[0] | counts[1] if counts[0][name] != counts[1][name])
    loop = per_image_loop(model)
    if loop is None:
        assert not varying, f"{model_type}'s forward runs {varying} a number of times that follows its images"
        return
    looping = [name for name, _ in model.named_modules() if fnmatch.fnmatchcase(name, loop[0])]
    assert looping and all(counts[0][name] == counts[1][name] for name in looping)  # called once, looping inside
    assert varying and all(any(name.startswith(f"{owner}.") for owner in looping) for name in varying), varying


# The ways out, for real


@pytest.fixture(scope="module")
def vision_models(tmp_path_factory):
    return save_vision_families(tmp_path_factory, "per_image_loops", MODELS)


single_process_padded = single_process_padded_fixture(
    {family: f"{family}:trl" for family in MODELS},
    *("--batch-size", str(2 * PAIRS_PER_PROCESS), *VISION_OPTIONS),
    models="vision_models",
)


def launch_padding_free(config: str, vision_models, output, families) -> dict:
    runs = {model_type: f"{model_type}:padding_free" for model_type in families}
    options = ("--runs", ",".join(runs.values()), "--batch-size", str(PAIRS_PER_PROCESS), *VISION_OPTIONS)
    reports = launch(config, vision_models, output, *options, *WATCHDOG)
    return {model_type: reports[run] for model_type, run in runs.items()}


def assert_same_training_with_images(report: dict, padded: dict, model_type: str) -> None:
    assert report["model_type"] == model_type and report["world_size"] == 2
    assert report["losses"][0] == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)  # policy and reference start equal
    assert len(report["losses"]) == STEPS
    assert_same_training(report, padded)
    for metrics in report["metrics"]:  # every sequence's images encoded from the packed row
        assert metrics["padfree/images_encoded"] == metrics["padfree/images_padded"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FSDP2_LAYERS)
def test_fsdp2_trains_a_family_that_loops_over_its_images_equal_to_one_padded_process(
    vision_models, single_process_padded, tmp_path, monkeypatch, model_type
):
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", FSDP2_LAYERS[model_type])
    report = launch_padding_free("fsdp2.yaml", vision_models, tmp_path / "report.json", [model_type])[model_type]
    assert report["fsdp_version"] == 2
    assert report["policy_fsdp"]["sharded"], "the policy's parameters are not DTensor shards: FSDP2 did not run"
    assert report["reference_fsdp"]["sharded"] and report["reference_fsdp"]["units"] > 1  # trl-padfree's, by layer
    assert_same_training_with_images(report, single_process_padded[model_type], model_type)


@pytest.fixture(scope="module")
def zero2_runs(vision_models, tmp_path_factory):
    output = tmp_path_factory.mktemp("zero2") / "report.json"
    return launch_padding_free("zero2.yaml", vision_models, output, ZERO2_FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ZERO2_FAMILIES)
def test_zero2_trains_a_family_with_an_untied_lm_head_equal_to_one_padded_process(
    zero2_runs, single_process_padded, model_type
):
    report = zero2_runs[model_type]
    assert report["engine_zero_stage"] == 2 and report["optimizer_partitioned"]
    assert not report["policy_sharded"]  # ZeRO-2 keeps the parameters whole: nothing gathered per call
    assert_same_training_with_images(report, single_process_padded[model_type], model_type)


@pytest.mark.slow
def test_zero3_over_two_processes_refuses_minicpm_v_at_construction(vision_models, tmp_path):
    # Without the refusal this launch aborts in the first step's forward (gloo "collective mismatch"), as TRL's padded
    # trainer does
    with pytest.raises(AssertionError, match="DeepSpeed ZeRO-3 cannot train MiniCPMV4_6ForConditionalGeneration"):
        launch_padding_free("zero3.yaml", vision_models, tmp_path / "report.json", ["minicpmv4_6"])


@pytest.mark.slow
def test_zero3_ulysses_on_one_row_whose_processes_each_encode_all_its_images_equals_one_padded_process(tmp_path):
    # Sequence parallelism runs under ZeRO-3 only: over one row shared by both processes, each encoding all of its
    # images (deal_images=False, the refusal's way out), both run PaddleOCR-VL's projector as many times
    directory = tmp_path / "models"
    save_vision_models(directory, ["paddleocr_vl"])
    # a row of 2 pairs per step, long enough that sequences and images cross the processes' chunks
    options = ("--vision", "--images-per-row", "3,2", "--num-pairs", "16", "--batch-size", str(PAIRS_PER_PROCESS),
               "--steps", str(STEPS), "--max-length", "1024")  # fmt: skip
    padded = train_in_this_process(directory, tmp_path / "single.json", "--runs", "paddleocr_vl:trl", *options)
    run = "paddleocr_vl:padding_free+sp+whole_images"
    options += ("--runs", run, "--sp-size", "2", *WATCHDOG)
    report = launch("zero3.yaml", directory, tmp_path / "report.json", *options)[run]
    assert report["zero_stage"] == 3 and report["policy_sharded"] and report["sequence_parallel_size"] == 2
    assert report["vision_tower_rows"]["dealt"] == 0 and report["vision_tower_rows"]["whole"] > 0
    assert_split_row_training(report, padded["paddleocr_vl:trl"])
