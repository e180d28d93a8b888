"""Every rank of a split row gets the row's micro-batches as tensors (parallel/batch_hand_out.py): the collators'
batches, text and vision-language, come back bit for bit from one rank's bytes; what it cannot send is refused; over
2 gloo processes a round is two tensor all-gathers and two host reads, no object collective."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_vision import make_vision_processor, vision_preference_rows

from tools.measure.measure_batch_hand_out import assert_same, text_examples
from trl_padfree.packing.collator import PaddingFreePreferenceCollator
from trl_padfree.packing.layout import HOST_ROW
from trl_padfree.packing.vision import IMAGE_UNITS, PaddingFreeVisionPreferenceCollator
from trl_padfree.parallel.batch_hand_out import ALIGN, _tensor_layout, batch_of, buffer_of, encoded

ROOT = Path(__file__).resolve().parents[2]


def round_trip(batch: dict) -> dict:
    header, tensors = encoded(batch)
    length = _tensor_layout(len(header), tensors)[-1] + ALIGN  # padded, as a shorter rank's buffer is
    return batch_of(buffer_of(header, tensors, length, torch.device("cpu")), header)


@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_a_text_batch_comes_back_bit_for_bit(prefix_sharing):
    batch = PaddingFreePreferenceCollator(pad_token_id=0, prefix_sharing=prefix_sharing)(text_examples(0, 5))
    assert isinstance(batch["max_length_q"], int) and batch["ref_chosen_logps"].dtype == torch.float32
    assert ("shared_prefix_lens" in batch) is prefix_sharing
    assert_same(round_trip(batch), batch)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava"])
def test_a_vision_batch_comes_back_bit_for_bit(model_type):
    rows = vision_preference_rows(model_type, 3, images_per_row=[2, 1, 0])
    batch = PaddingFreeVisionPreferenceCollator(make_vision_processor(model_type))(rows)
    assert batch[IMAGE_UNITS] is not None and batch[HOST_ROW].image_spans
    received = round_trip(batch)
    assert_same(received, batch)
    assert received["image_inputs"]["pixel_values"].data_ptr() % ALIGN == 0


def test_odd_values_come_back_and_other_objects_are_refused():
    odd = {
        "empty": torch.zeros(0, 3, dtype=torch.bfloat16), "scalar": torch.tensor(True), "flag": False, "none": None,
        "ratio": 0.1, "strided": torch.arange(12.0).view(3, 4).T, "nested": {"ids": [1, -2, (3, "x")]},
    }  # fmt: skip
    received = round_trip(odd)
    assert_same(received, {**odd, "strided": odd["strided"].contiguous()})

    @dataclasses.dataclass(frozen=True)
    class Unknown:
        value: int = 0

    with pytest.raises(TypeError, match=r"batch\['extra'\] is a Unknown"):
        encoded({"extra": Unknown()})
    with pytest.raises(TypeError, match="complex64"):
        encoded({"waves": torch.zeros(2, dtype=torch.complex64)})


@pytest.mark.slow
def test_two_gloo_processes_hand_each_other_their_batches_with_two_tensor_all_gathers():
    """Each rank receives the other's text and vision batch bit for bit (the script asserts it)."""
    import json

    from distributed_runs import checkout_environment

    script = ROOT / "tools" / "measure" / "measure_batch_hand_out.py"
    command = [sys.executable, str(script), "--repeats", "0", "--image-size", "56"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, env=checkout_environment())
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    for kind in ("text", "vision"):
        (name, calls), *others = report[kind]["tensors"]["collectives"].items()
        assert name in ("all_gather_single", "all_gather_into_tensor") and calls == 2 and not others
        assert report[kind]["tensors"]["host_reads"] == 2
