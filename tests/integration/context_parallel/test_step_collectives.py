"""What a training step of a split row asks of torch.distributed, counted in the worker processes of two-process gloo
runs (tests/support/distributed/step_collectives.py wraps torch.distributed's functions; `accelerate launch`): context
parallelism on text rows and on Qwen2.5-VL image rows (their images dealt over the ranks), and Ulysses under ZeRO-3.
Tiny models of 2 layers, 2 steps. docs/concepts/kernels.md gives the counts.

Slow (three launches): the default suite asserts no object collective on launches it makes anyway (`--count-collectives`
in test_context_parallel.py, test_sequence_parallel.py and test_vision_split_rows.py)."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow
from distributed_runs import launch, save_tiny_model  # noqa: E402
from tiny_vision import save_vision_models  # noqa: E402

from trl_padfree.parallel import image_shares  # noqa: E402

# Every rank of a row gets the row's micro-batches, per round two all-gathers (lengths, then each rank's header and
# tensors) and two host reads (the lengths, the headers)
BATCH_HAND_OUT = "parallel/batch_hand_out.py"
# Per step, the collectives of the split-row code (parallel/groups.py): gathers of keys and values, per-token outputs
# and image features, written in place, and their backward's reduce-scatters
SPLIT_ROW_COLLECTIVES = {
    "cp": {"all_gather_single": 11, "reduce_scatter_single": 4},
    "cp_images": {"all_gather_single": 17, "reduce_scatter_single": 4, "all_reduce": 1},
    "ulysses": {"all_gather_single": 7, "reduce_scatter_single": 1},
}


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict[str, list[dict]]:
    directory = tmp_path_factory.mktemp("collectives")
    tiny, vision = save_tiny_model(directory / "tiny"), directory / "vision"
    save_vision_models(vision, ("qwen2_5_vl",))
    common = ("--steps", "2", "--count-collectives")
    runs = {
        "cp": launch("multi_gpu.yaml", tiny, directory / "cp.json", "--runs", "padding_free+cp", *common),
        "cp_images": launch(
            "multi_gpu.yaml", vision, directory / "images.json", "--runs", "qwen2_5_vl:padding_free+cp", *common,
            "--vision", "--images-per-row", "3,2", "--max-length", "1024", "--num-pairs", "16", "--batch-size", "2",
        ),
        "ulysses": launch("zero3.yaml", tiny, directory / "sp.json", "--runs", "padding_free+sp", *common),
    }  # fmt: skip
    return {mode: next(iter(report.values()))["collectives"] for mode, report in runs.items()}


@pytest.mark.parametrize("mode", list(SPLIT_ROW_COLLECTIVES))
def test_a_split_row_step_makes_no_object_collective(counted, mode):
    for step in counted[mode]:
        assert step["object"] == 0, step["by_caller"]
        # Two all-gathers a round (lengths, then batches), in the steps whose micro-batches start a round
        hand_out = {caller: n for caller, n in step["by_caller"].items() if caller.endswith(BATCH_HAND_OUT)}
        assert set(hand_out) <= {f"all_gather_single {BATCH_HAND_OUT}"}, hand_out
        assert sum(hand_out.values()) % 2 == 0, hand_out
        split_row = {
            caller.split()[0]: n for caller, n in step["by_caller"].items() if caller.endswith("parallel/groups.py")
        }
        assert split_row == SPLIT_ROW_COLLECTIVES[mode]


def test_split_rows_read_the_host_only_to_exchange_image_feature_counts(counted):
    lines, first = inspect.getsourcelines(image_shares.images_dealt)
    tower_call = first + next(i for i, line in enumerate(lines) if "whole_row(*args" in line)
    for mode, steps in counted.items():
        for step in steps:
            reads = {
                where: n
                for where, n in step["split_row_host_reads_where"].items()
                if not where.startswith(BATCH_HAND_OUT) and where != f"parallel/image_shares.py:{tower_call}"
            }  # the tower's own reads (Qwen-VL's grid) are the model's, as in one process
            # Per dealt forward (policy and reference): the counts' lengths, then the counts
            assert sum(reads.values()) == (4 if mode == "cp_images" else 0), (mode, reads)
            hand_out = sum(
                n for where, n in step["split_row_host_reads_where"].items() if where.startswith(BATCH_HAND_OUT)
            )
            assert hand_out == step["by_caller"].get(f"all_gather_single {BATCH_HAND_OUT}", 0), hand_out
