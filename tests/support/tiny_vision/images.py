r"""The families whose processors lay images out whole (`layout="images"`): every image resized to one size, in
`pixel_values (images, 3, H, W)`.

gemma3, shieldgemma2 (a Gemma 3: Gemma3ForConditionalGeneration, Gemma 3's processor), llava, vipllava, video_llava,
deepseek_vl, deepseek_vl_hybrid, janus, aria.

    family          image inputs                                          per-token key (1 on)
    gemma3          pixel_values (4, 3, 32, 32)                           token_type_ids (soft tokens)
    shieldgemma2    as gemma3 (Gemma3ForConditionalGeneration, Gemma 3's processor)
    llava           pixel_values (4, 3, 32, 32)                           none
    video_llava     pixel_values_images (4, 3, 32, 32)                    none
    deepseek_vl     pixel_values (I, 3, 32, 32)                           none
    deepseek_vl_hybrid  as DeepSeek-VL, and high_res_pixel_values (I, 3, 64, 64)
    janus           pixel_values (I, 3, 32, 32)                           none

    family          config's image id   = processor.image_token_id   tokens per image (default options)
    gemma3          image_token_index   no: the processor's is boi   \n\n <boi> 4 x <image_soft_token> <eoi> \n\n
    llava           image_token_index   yes                          16 <image>
    video_llava     image_token_index   yes                          16 <image>, as LLaVA
    deepseek_vl(_h) image_token_id      yes                          16 <image_placeholder>
    janus           image_token_id      its tokenizer's (none on it) <begin_of_image> 16 <image_placeholder>
                                                                 <end_of_image>

Gemma3Processor's `image_token_id` is the begin-of-image token, its text placeholder, which it expands to the soft
tokens the model's `image_token_index` names.

Departures from the real checkpoints, so that every parameter trains: LLaVA takes the vision tower's last layer
(`vision_feature_layer=-1`, not -2) and freezes CLIP's post-layernorm, which LLaVA never uses; Gemma 3's tower has no
pooling head (`vision_use_head=False`) and its zero-initialised image projection gets small random values.
Video-LLaVA freezes its image tower's post-layernorm as LLaVA does, and its video tower, which image pairs never run.
DeepSeek-VL hybrid's zero-initialised gate on its SAM tower's global features gets a small random value; Janus's image
generator (VQ-VAE, generation embeddings, aligner and head), which understanding never runs, is frozen.

Video-LLaVA's processor here is a subclass without a video processor (tiny_vision.common). The Gemma 3, LLaVA,
DeepSeek-VL, Janus and Aria processors are the stock classes and save and reload.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from transformers import (
    AriaImageProcessorPil,
    AriaProcessor,
    DeepseekVLHybridImageProcessorPil,
    DeepseekVLHybridProcessor,
    DeepseekVLImageProcessorPil,
    DeepseekVLProcessor,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    JanusImageProcessorPil,
    JanusProcessor,
    LlavaImageProcessorPil,
    LlavaProcessor,
    VideoLlavaImageProcessor,
    VideoLlavaProcessor,
)

from trl_padfree.cli.bench.vision import WithoutVideoProcessor

from .common import HEAD_DIM, INIT_STD, SLIDING_WINDOW, TEXT, VISION, TinyFamily, freeze_post_layernorm

# Special tokens, given ids after the shipped tokenizer's 2048
GEMMA_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
LLAVA_TOKENS = ("<image>", "<video>")  # Video-LLaVA's processor also looks its video token up
# Janus's processor reads these names off its tokenizer
JANUS_TOKENS = {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"}
DEEPSEEK_VL_TOKENS = {"image_token": "<image_placeholder>"}  # DeepSeek-VL's processor reads it off its tokenizer
ARIA_TOKENS = {"image_token": "<|img|>"}  # Aria's processor reads it off its tokenizer

# --- Processors ---------------------------------------------------------------------------------------------------


def _gemma3_processor(model_type, tokenizer, template, image_size=32, image_seq_length=4):
    """Square images of `image_size` pixels, `image_seq_length` (a square number) tokens each; no pan and scan."""
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}, do_pan_and_scan=False)
    return Gemma3Processor(image_processor, tokenizer, chat_template=template, image_seq_length=image_seq_length)


def _llava_processor(model_type, tokenizer, template, image_size=32, patch_size=8):
    """Images resized and center-cropped to `image_size`; one token per `patch_size` patch (the CLS dropped)."""
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaProcessor(
        image_processor,
        tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, which the "default" strategy drops again
        chat_template=template,
    )


class TinyVideoLlavaProcessor(WithoutVideoProcessor, VideoLlavaProcessor):
    """`VideoLlavaProcessor` without a video processor."""


def _video_llava_processor(model_type, tokenizer, template, image_size=32, patch_size=8):
    """As `_llava_processor`, with Video-LLaVA's image processor (its images come back as `pixel_values_images`)."""
    image_processor = VideoLlavaImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return TinyVideoLlavaProcessor(
        image_processor, None, tokenizer, patch_size=patch_size, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=template,
    )  # fmt: skip


def _deepseek_vl_processor(model_type, tokenizer, template, image_size=32, patch_size=8, high_res_size=64):
    """Images resized to fit `image_size` and padded square, a token per `patch_size` patch; the hybrid's processor
    also gives each image at `high_res_size` (for its SAM tower, whose features are resized to the same tokens)."""
    size = {"height": image_size, "width": image_size}
    tokens = (image_size // patch_size) ** 2
    if model_type == "deepseek_vl":
        image_processor = DeepseekVLImageProcessorPil(size=size)
        return DeepseekVLProcessor(image_processor, tokenizer, chat_template=template, num_image_tokens=tokens)
    image_processor = DeepseekVLHybridImageProcessorPil(
        size=size, high_res_size={"height": high_res_size, "width": high_res_size}
    )
    return DeepseekVLHybridProcessor(image_processor, tokenizer, chat_template=template, num_image_tokens=tokens)


def _janus_processor(model_type, tokenizer, template, image_size=32, patch_size=8):
    """Images resized to fit `image_size` and padded square, a token per `patch_size` patch between begin and end of
    image tokens."""
    image_processor = JanusImageProcessorPil(size={"height": image_size, "width": image_size})
    tokens = (image_size // patch_size) ** 2
    return JanusProcessor(image_processor, tokenizer, chat_template=template, num_image_tokens=tokens)


def _aria_processor(model_type, tokenizer, template, patch_size=140, image_tokens=4):
    """Images resized to Aria's 980 pixels on their longer side (the processor takes 490 or 980, and calls its image
    processor at 980) and padded square, with a pixel mask of the image; towers of `patch_size` patches (7 x 7 of them)
    make few patches of the large image, which its projector's `image_tokens` queries read."""
    image_processor = AriaImageProcessorPil(max_image_size=980, min_image_size=patch_size)
    processor = AriaProcessor(image_processor, tokenizer, chat_template=template, size_conversion={980: image_tokens})
    processor.patch_size = patch_size  # read back by `_aria_config`
    return processor


# --- Configs ------------------------------------------------------------------------------------------------------


def _gemma3_config(model_type, processor):
    """Gemma 3: a SigLIP tower without its pooling head (unused by Gemma 3), average-pooled to the processor's
    `image_seq_length` tokens by a 2 x 2 kernel."""
    image_size = processor.image_processor.size["height"]
    tokens_per_side = math.isqrt(processor.image_seq_length)
    if tokens_per_side**2 != processor.image_seq_length or image_size % (2 * tokens_per_side):
        raise ValueError(
            f"Gemma 3 needs a square image_seq_length dividing the image side: {processor.image_seq_length}"
        )
    tokenizer = processor.tokenizer
    text = dict(
        TEXT,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(VISION, image_size=image_size, patch_size=image_size // (2 * tokens_per_side), vision_use_head=False)
    return dict(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=processor.image_seq_length,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
    )


def _llava_config(model_type, processor):
    """LLaVA: a CLIP tower whose last layer's patch features (CLS dropped) feed the projector."""
    image_size = processor.image_processor.crop_size["height"]
    vision = dict(VISION, image_size=image_size, patch_size=processor.patch_size, projection_dim=VISION["hidden_size"])
    return dict(
        text_config=dict(TEXT),
        vision_config=vision,
        image_token_index=processor.image_token_id,
        image_seq_length=(image_size // processor.patch_size) ** 2,
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        vision_feature_layer=-1,  # the real checkpoints' -2 would leave the last vision layer without gradients
    )


def _video_llava_config(model_type, processor):
    """Video-LLaVA: LLaVA's geometry (`_llava_config`) on its CLIP image tower, beside a video tower of the same
    shape that image pairs never run."""
    values = _llava_config(model_type, processor)
    values["video_token_index"] = processor.video_token_id
    values["vision_config"].pop("projection_dim")
    return values


def _vipllava_config(model_type, processor):
    """VipLLaVA: LLaVA whose projector reads the patch features (CLS dropped) of several vision layers, here both."""
    values = _llava_config(model_type, processor)
    del values["vision_feature_select_strategy"], values["vision_feature_layer"]
    return values | dict(vision_feature_layers=[-1, 0])


def _deepseek_vl_config(model_type, processor):
    """DeepSeek-VL: a SigLIP tower (no pooling head: DeepSeek-VL reads its patches), a token per patch, Llama; the
    hybrid adds a SAM tower on the high-resolution copy, its features resized to SigLIP's grid of patches."""
    image_processor = processor.image_processor
    image_size = image_processor.size["height"]
    patch_size = image_size // math.isqrt(processor.num_image_tokens)
    vision = dict(
        VISION, model_type="siglip_vision_model", image_size=image_size, patch_size=patch_size, vision_use_head=False
    )
    values = dict(text_config=dict(TEXT), vision_config=vision, image_token_id=processor.image_token_id)
    if model_type == "deepseek_vl_hybrid":
        high_res_size = image_processor.high_res_size["height"]
        values["high_res_vision_config"] = dict(
            VISION, model_type="sam_vision_model", image_size=high_res_size, patch_size=high_res_size // 4,
            output_channels=8, mlp_dim=VISION["intermediate_size"], window_size=2, global_attn_indexes=[1],
            num_pos_feats=16,
        )  # fmt: skip
    return values


def _janus_config(model_type, processor):
    """Janus: its own SigLIP-like tower, a token per patch, Llama; and an image generator (a VQ-VAE with its own
    embeddings, aligner and head) that understanding never runs, here as small as it builds (GroupNorm of 32)."""
    image_size = processor.image_processor.size["height"]
    patch_size = image_size // math.isqrt(processor.num_image_tokens)
    hidden = TEXT["hidden_size"]
    vision = dict(
        VISION, image_size=image_size, patch_size=patch_size, num_image_tokens=processor.num_image_tokens,
        projection_dim=hidden, mlp_ratio=2.0,
    )  # fmt: skip
    vq = dict(
        embed_dim=8, num_embeddings=16, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
        num_res_blocks=1, projection_dim=hidden, image_token_embed_dim=hidden,
    )  # fmt: skip
    return dict(
        text_config=dict(TEXT),
        vision_config=vision,
        vq_config=vq,
        image_token_id=processor.tokenizer.image_token_id,
    )


def _aria_config(model_type, processor):
    """Aria: Idefics3's tower over 980-pixel images in `processor.patch_size` patches, read by a fixed number of
    queries per image (its projector's cross-attention, by patch count), before a MoE language model."""
    image_size = processor.image_processor.max_image_size
    patches = (image_size // processor.patch_size) ** 2
    text = dict(TEXT, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1)
    return dict(
        text_config=text,
        vision_config=dict(VISION, image_size=image_size, patch_size=processor.patch_size),
        projector_patch_to_query_dict={patches: processor.size_conversion[image_size]},
        image_token_index=processor.image_token_id,
    )


# --- Model fix-ups ------------------------------------------------------------------------------------------------


def _draw_image_projection(model) -> None:
    """Gemma 3 initialises its image projection to zero, which would cut every gradient to the vision tower."""
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=INIT_STD)


def _freeze_unused_towers(model) -> None:
    """Video-LLaVA: as LLaVA's, its image tower's post-layernorm gets no gradient; and image pairs never run its video
    tower."""
    model.model.image_tower.post_layernorm.requires_grad_(False)
    model.model.video_tower.requires_grad_(False)


def _draw_high_res_gate(model) -> None:
    """DeepSeek-VL hybrid's SAM tower's global features enter through a gate initialised to zero, which would cut
    their gradients."""
    torch.nn.init.normal_(model.model.high_res_vision_alpha, std=INIT_STD)


def _freeze_image_generator(model) -> None:
    """Janus's image generator, which understanding never runs."""
    for module in (model.model.vqmodel, model.model.generation_embeddings, model.model.generation_aligner,
                   model.model.generation_head):  # fmt: skip
        module.requires_grad_(False)


# --- The families -------------------------------------------------------------------------------------------------

_GEMMA3 = TinyFamily(
    tokens=tuple(GEMMA_TOKENS.values()),
    placeholder=GEMMA_TOKENS["boi_token"],
    processor=_gemma3_processor,
    config=_gemma3_config,
    # Gemma3Processor reads `tokenizer.boi_token`, `.image_token`, `.eoi_token` and their ids
    named_tokens=GEMMA_TOKENS,
    prepare_model=_draw_image_projection,
    tags={"before_2026"},
)
_LLAVA = TinyFamily(
    tokens=LLAVA_TOKENS,
    placeholder="<image>",
    processor=_llava_processor,
    config=_llava_config,
    prepare_model=freeze_post_layernorm,
    tags={"before_2026"},
)
_DEEPSEEK_VL = TinyFamily(
    tokens=tuple(DEEPSEEK_VL_TOKENS.values()),
    placeholder=DEEPSEEK_VL_TOKENS["image_token"],
    processor=_deepseek_vl_processor,
    config=_deepseek_vl_config,
    named_tokens=DEEPSEEK_VL_TOKENS,
)

TINY_FAMILIES = {
    "gemma3": _GEMMA3,
    # ShieldGemma 2 is a Gemma 3 (AutoModelForImageTextToText builds Gemma3ForConditionalGeneration from its config);
    # its own processor writes policy prompts and refuses text without images, which TRL's collator sends for the
    # completions, so it trains with Gemma 3's processor. transformers 5.24 saves Gemma3ForConditionalGeneration under
    # its config with a key layout its own loading does not read back (ShieldGemma 2's conversion mapping is its
    # classifier's, whose `model` holds the Gemma 3): every language-model weight missing, initialised anew at each
    # load. Saved in its own layout, it loads back
    "shieldgemma2": replace(_GEMMA3, save_original_format=False, tags=()),
    "llava": _LLAVA,
    "vipllava": replace(_LLAVA, config=_vipllava_config, prepare_model=None),  # LLaVA's processor, as its checkpoints
    "video_llava": replace(
        _LLAVA,
        processor=_video_llava_processor,
        config=_video_llava_config,
        prepare_model=_freeze_unused_towers,
        tags=(),
    ),
    "deepseek_vl": _DEEPSEEK_VL,
    "deepseek_vl_hybrid": replace(_DEEPSEEK_VL, prepare_model=_draw_high_res_gate),
    "janus": TinyFamily(
        tokens=tuple(JANUS_TOKENS.values()),
        placeholder=JANUS_TOKENS["image_token"],
        processor=_janus_processor,
        config=_janus_config,
        named_tokens=JANUS_TOKENS,
        prepare_model=_freeze_image_generator,
    ),
    "aria": TinyFamily(
        tokens=tuple(ARIA_TOKENS.values()),
        placeholder=ARIA_TOKENS["image_token"],
        processor=_aria_processor,
        config=_aria_config,
        named_tokens=ARIA_TOKENS,
    ),
}
