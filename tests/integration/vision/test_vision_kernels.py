"""Vision-language families through the CUDA branches, at the real checkpoints' dims: one padding-free step under
the strict stand-ins of torch 2.15's varlen kernel and, for hybrid language models, of the mixer kernels
(tests/support/stand_in_kernels.py: bf16/fp16 only, head dims at most 256 and a multiple of 8, one head dim for query, key and
value, ...) equals TRL's padded vision trainer in TRL's default precision (float32 weights under bf16 autocast), and
every language-model attention call of the policy and the reference went where the plan puts it.

The tiny models of tests/support/tiny_vision/ have 8-wide heads; here their language model takes the dims of the family's
default config (`real_head_dims`), so the kernels' checks run on the shapes a real checkpoint hands them. What the plan
does with each (docs/concepts/kernels.md):

    head dims at most 256                the kernel, every attention layer, one call each
    Gemma 4's global layers (512)        per segment; its sliding layers (256) on the kernel
    latent attention (Kimi K2.5)         query and key 192, value 128: the value zero-padded to 192, output cropped
    images attended both ways            a second call per layer for the image spans (ShieldGemma 2, Gemma 4 Unified)
    Qwen3.5's delta-net (MiniCPM-V)      fla's chunk_gated_delta_rule on the whole row, given cu_seqlens
    LFM3's width-7 convolution           refused where causal-conv1d is installed (it takes widths 2 to 4); without
                                         it the PyTorch convolution per sequence, attention on the kernel
    HY-V4-VL (its indexer reads a mask)  exact on eager only: `auto` picks eager, padfree_varlen is refused
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from stand_in_kernels import CALLS, FLASH_MAX_HEAD_DIM, MIXER_STAND_INS, calls_of, varlen_stand_in
from tiny_vision import (
    EAGER_FAMILIES,
    GOT_OCR2_FAMILIES,
    MINICPM_FAMILIES,
    make_vision_config,
    make_vision_processor,
    make_vision_trainer,
    vision_preference_rows,
)
from tolerances import HALF_GRAD_ATOL_BY_FAMILY
from trainer_utils import PRECISIONS, assert_same_step, one_step
from transformers import AutoConfig

from trl_padfree.integrations.transformers import kernel_wrapper
from trl_padfree.modeling.attention import varlen
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.modeling.check.twin import HEAD_DIM_FIELDS, real_head_dim

TRL_DEFAULT = PRECISIONS["trl_default"]
# By default two of the families added in 2026 (patches of each kind); with -m slow one of each earlier layout too,
# and every family issue 44 added (the default suite is over its time budget)
KERNEL_FAMILIES = ("glm_ocr", "paddleocr_vl")
SLOW_KERNEL_FAMILIES = ("qwen3_vl", "llava_next", "internvl", "idefics3")
SLOW_KERNEL_FAMILIES += (
    "kimi_k25", "gemma4", "gemma4_unified", "shieldgemma2", "cosmos3_omni", "cosmos3_edge", "hyperclovax_vision_v2",
    "video_llava", "qianfan_ocr", "deepseek_vl", "deepseek_vl_hybrid", "granite4_vision", "ovis2", "janus", "glmga",
    "exaone4_5", *MINICPM_FAMILIES, *GOT_OCR2_FAMILIES,
)  # fmt: skip
# Image tokens that attend to their whole image: a causal and an image-span kernel call per layer
BOTH_WAYS = ("shieldgemma2", "gemma4_unified")
PADDED_ATTENTION: dict[str, str] = {}
# Other heads beside the attention's: the delta-net's, which fla's kernel checks (key head dims at most 256); HY-V4's
# sparse indexer's, which splits off the rope part as its attention does
OTHER_HEAD_DIM_FIELDS = ("linear_key_head_dim", "linear_value_head_dim", "index_head_dim")
# GLM-4V's attention takes its head dim from the hidden size over the heads (its rotary reads `head_dim`)
HEAD_DIM_FROM_HIDDEN_SIZE = ("glm4v_text",)


@pytest.fixture(autouse=True)
def fresh_records():
    CALLS.clear()
    varlen._log_fallback_once.cache_clear()  # each test sees the per-segment reasons logged
    yield
    CALLS.clear()


def real_head_dims(model_type: str) -> dict:
    """Overrides giving the tiny model's language model the head dims of the default config: `head_dim` (else the
    hidden size over the heads), Gemma 4's global layers' (its default config states them per layer), latent
    attention's query/key and value dims, the delta-net's and a sparse indexer's; mRoPE sections the default
    config's, or (most leave them to the checkpoints) the tiny model's scaled to cover the rotary half of a head."""
    real = AutoConfig.for_model(model_type).get_text_config().to_dict()
    tiny = make_vision_config(model_type, make_vision_processor(model_type)).get_text_config().to_dict()
    overrides = {name: real[name] for name in HEAD_DIM_FIELDS + OTHER_HEAD_DIM_FIELDS if real.get(name) is not None}
    overrides["head_dim"] = real_head_dim(real)
    vision = {}
    if tiny["model_type"] in HEAD_DIM_FROM_HIDDEN_SIZE:  # the hidden size widened to fit, the tower's output with it
        overrides["hidden_size"] = vision["out_hidden_size"] = overrides["head_dim"] * tiny["num_attention_heads"]
    per_layer = {layer.get("head_dim") for layer in (real.get("per_layer_config") or {}).values()} - {None}
    if per_layer:  # Gemma 4's global layers
        assert len(per_layer) == 1, (model_type, per_layer)
        overrides["global_head_dim"] = per_layer.pop()
    rope = dict(tiny.get("rope_parameters") or {})
    if "mrope_section" in rope:
        real_sections = (real.get("rope_parameters") or {}).get("mrope_section")
        # Else the tiny's proportions over the rotary half of the rope part (latent attention rotates its rope dims)
        rotary = (overrides.get("qk_rope_head_dim") or overrides["head_dim"]) * rope.get("partial_rotary_factor", 1)
        scale, rest = divmod(int(rotary) // 2, sum(rope["mrope_section"]))
        assert real_sections or rest == 0, (model_type, rotary)
        sections = real_sections or [section * scale for section in rope["mrope_section"]]
        overrides["rope_parameters"] = rope | {"mrope_section": sections}
    return {"text_config": overrides} | ({"vision_config": vision} if vision else {})


def kernel_plan(model_type: str, text) -> tuple[int, set[int], set[int]]:
    """Attention layers the plan puts on the kernel, the head dims it hands the kernel, and those of the layers it
    runs per segment: every attention layer (not a delta-net or a convolution) at most 256 wide goes to the kernel,
    latent attention's value zero-padded to the query's head dim."""
    dims = real_head_dims(model_type)["text_config"]
    if "qk_nope_head_dim" in dims:
        query = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
        assert dims["v_head_dim"] <= query, dims  # a wider value than the query's is not padded: per segment
    else:
        query = dims["head_dim"]
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    widths = [
        dims.get("global_head_dim", query) if kind == "full_attention" else query
        for kind in kinds
        if kind.endswith("attention") and kind != "linear_attention"
    ]
    on_kernel = [width for width in widths if width <= FLASH_MAX_HEAD_DIM]
    return len(on_kernel), set(on_kernel), set(widths) - set(on_kernel)


def packed_step_through_stand_ins(
    model_type: str, data, options: dict, mixers: bool = False, padded_attention: str | None = None
):
    """TRL's padded step (on `padded_attention`, default the model's), and the padding-free step with the stand-ins
    in force (the mixers' too with `mixers`)."""
    padded_options = options | ({"attn_implementation": padded_attention} if padded_attention else {})
    padded = one_step(make_vision_trainer(model_type, False, data, **padded_options))
    make_vision_trainer(model_type, True, data, **options)  # imports the model's modules
    with stand_in_kernels(varlen=varlen_stand_in("2.15"), mixer_kernels=MIXER_STAND_INS if mixers else None):
        trainer = make_vision_trainer(model_type, True, data, **options)
        CALLS.clear()
        packed = one_step(trainer)
    return trainer, padded, packed


@pytest.mark.parametrize(
    "model_type",
    [*KERNEL_FAMILIES, *(pytest.param(family, marks=pytest.mark.slow) for family in SLOW_KERNEL_FAMILIES)],
)
def test_one_step_through_the_kernel_at_real_head_dims_equals_padded_trl(model_type, caplog):
    data = vision_preference_rows(model_type, 8, images_per_row=(1, 2, 1, 1))
    options = dict(TRL_DEFAULT.trainer_options, model_overrides=real_head_dims(model_type))
    hybrid = model_type in MINICPM_FAMILIES
    with caplog.at_level(logging.INFO, logger="trl_padfree.modeling.attention.varlen"):
        trainer, padded, packed = packed_step_through_stand_ins(
            model_type, data, options, mixers=hybrid, padded_attention=PADDED_ATTENTION.get(model_type)
        )

    grad_atol = HALF_GRAD_ATOL_BY_FAMILY.get(model_type)
    assert_same_step(padded, packed, grad_atol=grad_atol, tolerances=TRL_DEFAULT.tolerances)
    layers, head_dims, per_segment = kernel_plan(model_type, trainer.model.config.get_text_config())
    for width in per_segment:  # Gemma 4's global layers: per segment, and the log says why
        assert f"head dim {width} (the Flash kernel takes at most {FLASH_MAX_HEAD_DIM})" in caplog.text
    calls = calls_of("varlen_attn")
    # Policy and reference forwards: every language-model attention layer the plan puts on the kernel, at the real
    # head dim (the wider layers per segment)
    assert {call.details["head_dim"] for call in calls} == head_dims
    assert {call.details["input_dtype"] for call in calls} == {torch.bfloat16}
    if model_type in BOTH_WAYS:  # per layer a causal call and one for the image spans, seen to their end
        image_spans = [call for call in calls if call.details["window_size"][1] == -1]
        assert len(image_spans) == 2 * layers and len(calls) == 4 * layers
    else:
        assert len(calls) == 2 * layers
    if hybrid:  # every delta-net layer's row through fla's kernel, given the boundaries
        mixer_calls = calls_of("chunk_gated_delta_rule")
        assert mixer_calls and all(call.boundaries.dtype == torch.int32 for call in mixer_calls)


@pytest.mark.slow
def test_lfm3_vls_width_7_convolution_is_refused_under_causal_conv1d_and_its_attention_reaches_the_kernel():
    model_type = "lfm3_vl"
    data = vision_preference_rows(model_type, 8, images_per_row=(1, 2, 1, 1))
    options = dict(TRL_DEFAULT.trainer_options, model_overrides=real_head_dims(model_type))
    model = make_vision_trainer(model_type, True, data, **options).model  # imports the model's modules
    language_model = model.get_decoder()
    if kernel_wrapper(vars(sys.modules[type(language_model).__module__]).get("causal_conv1d_fn")) is not None:
        # transformers 5.24 hands LFM3's width-7 convolution to causal-conv1d, which takes widths 2 to 4: refused at
        # once where it is installed, with the way out (5.23: PyTorch code of its own, per sequence)
        with stand_in_kernels(varlen=varlen_stand_in("2.15"), mixer_kernels=MIXER_STAND_INS):
            with pytest.raises(ValueError, match="convolve over 7 tokens") as error:
                make_vision_trainer(model_type, True, data, **options)
        assert "Uninstall causal-conv1d" in str(error.value)
    # Without causal-conv1d: transformers' PyTorch convolution, once per sequence; the attention layers on the kernel
    trainer, padded, packed = packed_step_through_stand_ins(model_type, data, options)

    assert_same_step(padded, packed, tolerances=TRL_DEFAULT.tolerances)
    layers, head_dims, _ = kernel_plan(model_type, trainer.model.config.get_text_config())
    calls = calls_of("varlen_attn")
    assert len(calls) == 2 * layers and {call.details["head_dim"] for call in calls} == head_dims


@pytest.mark.slow
@pytest.mark.parametrize("model_type", EAGER_FAMILIES)
def test_an_eager_only_family_at_real_head_dims_never_reaches_the_kernel(model_type):
    # HY-V4-VL's sparse indexer reads the attention mask: `auto` picks eager on the CUDA branches too, and the kernel
    # (which honours no mask) is refused, though its latent attention's head dims (256 for query, key and value) fit it
    data = vision_preference_rows(model_type, 8, images_per_row=(1, 2, 1, 1))
    options = dict(
        TRL_DEFAULT.trainer_options, model_overrides=real_head_dims(model_type), attn_implementation="eager"
    )
    trainer, padded, packed = packed_step_through_stand_ins(model_type, data, options)

    assert_same_step(padded, packed, tolerances=TRL_DEFAULT.tolerances)
    assert not calls_of("varlen_attn")
    with stand_in_kernels(varlen=varlen_stand_in("2.15")), pytest.raises(ValueError, match="cannot train"):
        make_vision_trainer(model_type, True, data, **options, packed_attn_implementation="padfree_varlen")
