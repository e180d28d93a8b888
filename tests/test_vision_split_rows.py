"""Sequence and context parallelism on vision-language rows, for real: two or four CPU processes over gloo share each
packed row (`accelerate launch`, tests/distributed/train_dpo.py --vision), against TRL's padded vision trainer in one
process on the same global batches (distributed_runs' fp32 bounds, grad_norm included).

Every rank runs the model's own forward up to its language model on the whole row: the text embeddings, the vision
tower on all of the row's images, their features placed on the image tokens, the positions (Qwen-VL's
`get_rope_index`); the language model then runs this rank's chunk (parallel/row_split.py,
`language_model_on_chunk`). The rows are long enough that sequences, and images, cross the chunk boundaries.
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from distributed_runs import assert_split_row_training, launch, train_in_this_process  # noqa: E402
from tiny_vision import make_vision_model, make_vision_processor  # noqa: E402

# Qwen2.5-VL: mRoPE positions from the whole row; Qwen3-VL: deepstack features added inside the language model;
# LLaVA-NeXT: any-resolution tiles; InternVL: tiles; Gemma 3: image spans attended both ways (Ulysses only)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "llava_next", "internvl", "gemma3")
CONTEXT_PARALLEL = ("qwen2_5_vl", "qwen3_vl", "llava_next", "internvl")
PAIRS_PER_PROCESS = 2
STEPS = 3
IMAGES_PER_ROW = "3,2"
VISION_OPTIONS = ("--vision", "--images-per-row", IMAGES_PER_ROW, "--steps", str(STEPS), "--max-length", "1024")  # fmt: skip


def pairs(processes: int) -> tuple[str, ...]:
    """The same dataset for every run (the sampler's order depends on its size), whole batches for up to 4 processes:
    one row of `PAIRS_PER_PROCESS` pairs per step, each step one of the row's ranks' micro-batches."""
    return ("--num-pairs", str(PAIRS_PER_PROCESS * 8), "--batch-size", str(PAIRS_PER_PROCESS))


@pytest.fixture(scope="module")
def vision_models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vision_models")
    for model_type in FAMILIES:
        processor = make_vision_processor(model_type)
        make_vision_model(model_type, processor).save_pretrained(directory / model_type)
        if model_type in ("llava_next", "gemma3"):  # the others' processors here cannot save: rebuilt instead
            processor.save_pretrained(directory / model_type)
    return directory


@pytest.fixture(scope="module")
def single_process_padded(vision_models, tmp_path_factory):
    output = tmp_path_factory.mktemp("single") / "report.json"
    runs = ",".join(f"{model_type}:trl" for model_type in FAMILIES)
    reports = train_in_this_process(vision_models, output, "--runs", runs, *pairs(1), *VISION_OPTIONS)
    return {model_type: reports[f"{model_type}:trl"] for model_type in FAMILIES}


@pytest.fixture(scope="module")
def context_parallel_runs(vision_models, tmp_path_factory):
    output = tmp_path_factory.mktemp("cp") / "report.json"
    runs = ",".join(f"{model_type}:padding_free+cp" for model_type in CONTEXT_PARALLEL)
    options = ("--runs", runs, "--cp-size", "2", *pairs(2), *VISION_OPTIONS)
    reports = launch("multi_gpu.yaml", vision_models, output, *options)
    return {model_type: reports[f"{model_type}:padding_free+cp"] for model_type in CONTEXT_PARALLEL}


@pytest.mark.parametrize("model_type", CONTEXT_PARALLEL)
def test_context_parallel_2_on_image_rows_equals_one_padded_process(
    context_parallel_runs, single_process_padded, model_type
):
    report = context_parallel_runs[model_type]
    assert report["model_type"] == model_type and report["context_parallel_size"] == 2
    assert_split_row_training(report, single_process_padded[model_type])
    assert report["images_split_across_ranks"] > 0, "no image crossed a chunk boundary: nothing was tested"


def launch_ulysses(vision_models, tmp_path_factory, model_type: str, run: str, processes: int = 2, *options) -> dict:
    """One run in its own `accelerate launch`: DeepSpeed sets sequence parallelism up once per process."""
    output = tmp_path_factory.mktemp(f"{model_type}_{run}") / "report.json"
    arguments = ("--runs", f"{model_type}:{run}", "--sp-size", "2", *pairs(processes), *VISION_OPTIONS, *options)
    return launch("zero3.yaml", vision_models, output, *arguments, processes=processes)[f"{model_type}:{run}"]


# Each Ulysses run is a launch of its own: the default suite runs the two families with their own paths through the
# language model (Qwen3-VL's deepstack features, Gemma 3's image spans), `-m slow` the others
ULYSSES_DEFAULT = ("qwen3_vl", "gemma3")


@pytest.mark.parametrize(
    "model_type",
    [family if family in ULYSSES_DEFAULT else pytest.param(family, marks=pytest.mark.slow) for family in FAMILIES],
)
def test_ulysses_2_on_image_rows_equals_one_padded_process(
    vision_models, tmp_path_factory, single_process_padded, model_type
):
    report = launch_ulysses(vision_models, tmp_path_factory, model_type, "padding_free+sp")
    assert report["model_type"] == model_type and report["sequence_parallel_size"] == 2
    assert report["zero_stage"] == 3 and report["policy_sharded"]
    assert_split_row_training(report, single_process_padded[model_type])
    assert report["images_split_across_ranks"] > 0, "no image crossed a chunk boundary: nothing was tested"


BOTH = ("qwen2_5_vl", "llava_next")


@pytest.mark.parametrize("model_type", [BOTH[0], pytest.param(BOTH[1], marks=pytest.mark.slow)])
def test_ulysses_times_context_4_on_image_rows_equals_one_padded_process(
    vision_models, tmp_path_factory, single_process_padded, model_type
):
    report = launch_ulysses(vision_models, tmp_path_factory, model_type, "padding_free+cp+sp", 4, "--cp-size", "2")
    assert report["world_size"] == 4
    assert report["sequence_parallel_size"] == 2 and report["context_parallel_size"] == 2
    assert_split_row_training(report, single_process_padded[model_type])
    assert report["images_split_across_ranks"] > 0, "no image crossed a chunk boundary: nothing was tested"
