"""Vision-language families through the CUDA branches, at the real checkpoints' head dims: one padding-free step
under the strict stand-in of torch 2.15's varlen kernel (tests/stand_in_kernels.py: bf16/fp16 only, head dims at
most 256 and a multiple of 8, ...) equals TRL's padded vision trainer in TRL's default precision (float32 weights
under bf16 autocast), and every language-model attention call of the policy and the reference reached the kernel.

The tiny models of tests/tiny_vision.py have 8-wide heads; here their language model's heads take the width of the
family's default config (`real_head_dims`, mRoPE sections scaled with it), so the kernel's head-dim checks
run on the shapes a real checkpoint hands it. Families whose heads are wider than the kernel takes run per segment
on a GPU: they are not listed here (docs/concepts/kernels.md).
"""

from __future__ import annotations

import pytest
import torch
from stand_in_kernels import CALLS, calls_of, varlen_stand_in
from tiny_vision import make_vision_config, make_vision_processor, make_vision_trainer, vision_preference_rows
from trainer_utils import PRECISIONS, assert_same_step, one_step
from transformers import AutoConfig

from trl_padfree.modeling.kernels import stand_in_kernels

TRL_DEFAULT = PRECISIONS["trl_default"]
# By default two of the families added in 2026 (patches of each kind); with -m slow one of each earlier layout too
KERNEL_FAMILIES = ("glm_ocr", "paddleocr_vl")
SLOW_KERNEL_FAMILIES = ("qwen3_vl", "llava_next", "internvl", "idefics3")


def real_head_dims(model_type: str) -> dict:
    """Overrides giving the tiny model's language model the head dim of the default config; mRoPE sections (which
    the default configs leave to the checkpoints) scaled with it, so they still cover the rotary half of a head."""
    real = AutoConfig.for_model(model_type).get_text_config()
    head_dim = getattr(real, "head_dim", None) or real.hidden_size // real.num_attention_heads
    tiny = make_vision_config(model_type, make_vision_processor(model_type)).get_text_config()
    overrides = {"head_dim": head_dim}
    rope = dict(getattr(tiny, "rope_parameters", None) or {})
    if "mrope_section" in rope:
        scale, rest = divmod(head_dim, getattr(tiny, "head_dim", None) or tiny.hidden_size // tiny.num_attention_heads)
        assert rest == 0, (model_type, head_dim)
        overrides["rope_parameters"] = rope | {"mrope_section": [section * scale for section in rope["mrope_section"]]}
    return {"text_config": overrides}


@pytest.mark.parametrize(
    "model_type",
    [*KERNEL_FAMILIES, *(pytest.param(family, marks=pytest.mark.slow) for family in SLOW_KERNEL_FAMILIES)],
)
def test_one_step_through_the_kernel_at_real_head_dims_equals_padded_trl(model_type):
    data = vision_preference_rows(model_type, 8, images_per_row=(1, 2, 1, 1))
    options = dict(TRL_DEFAULT.trainer_options, model_overrides=real_head_dims(model_type))
    padded = one_step(make_vision_trainer(model_type, False, data, **options))
    make_vision_trainer(model_type, True, data, **options)  # imports the model's modules
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        trainer = make_vision_trainer(model_type, True, data, **options)
        CALLS.clear()
        packed = one_step(trainer)

    assert_same_step(padded, packed, tolerances=TRL_DEFAULT.tolerances)
    text = trainer.model.config.get_text_config()
    calls = calls_of("varlen_attn")
    # Policy and reference forwards, every language-model attention layer, at the real head dim
    assert len(calls) >= 2 * text.num_hidden_layers
    assert {call.details["head_dim"] for call in calls} == {text.head_dim}
    assert {call.details["input_dtype"] for call in calls} == {torch.bfloat16}
