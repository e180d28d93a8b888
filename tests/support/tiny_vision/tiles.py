"""The families whose processors cut images into tiles (`layout="tiles"`): every tile of every image in
`pixel_values (tiles, 3, H, W)`, a fixed number of tokens each.

internvl, aya_vision, qianfan_ocr (InternVL's tiles before Qwen3), ovis2 (a whole image, then its tiles), got_ocr2 and
pp_chart2table (GOT-OCR2's model under its own processor).

    family          image inputs                                          per-token key (1 on)
    internvl        pixel_values (tiles, 3, 32, 32)                       none (1-4 tiles and a thumbnail per image)
    aya_vision      pixel_values (tiles, 3, 32, 32)                       none (as InternVL)
    qianfan_ocr     pixel_values (tiles, 3, 32, 32)                       none (as InternVL)
    ovis2           pixel_values (tiles, 3, 32, 32)                       none (a whole image, then 1-4 tiles if more)
    got_ocr2        pixel_values (tiles, 3, 32, 32)                       none (1-4 tiles and a thumbnail per image)
    pp_chart2table  pixel_values (I, 3, 32, 32)                           none (an image a tile)

    family          config's image id   = processor.image_token_id   tokens per image (default options)
    internvl        image_token_id      yes                          <img> 4 x <IMG_CONTEXT> per tile </img>
    qianfan_ocr     image_token_id      yes                          as InternVL, for the template's <image>
    aya_vision      image_token_index   yes                          TILE_k 4 x <|IMG_PATCH|> per tile, in START/END
    ovis2           image_token_id      no: <image>, the model's is  <IMG_START> 4 x <IMG_ATOM> <IMG_GRID> then 4 per
                                        <IMG_ATOM>                   tile between <IMG_COL> / <IMG_ROW>, <IMG_END>
    got_ocr2        image_token_index   yes                          <img> 4 x <imgpad> per tile </img>
    pp_chart2table  image_token_index   no: the template writes the  <img> 4 x <imgpad> </img>
                                        tokens, the processor none

Departures from the real checkpoints, so that every parameter trains: Aya Vision freezes its tower's post-layernorm,
as LLaVA (tiny_vision.images). Qianfan-OCR's tower drops no path (`drop_path_rate=0`, the checkpoints' 0.1 would drop
different layers in the padded and the packed step).

InternVL's processor here is a subclass without a video processor (tiny_vision.common). GOT-OCR2's and
PP-Chart2Table's processors refuse text without images, which TRL's collator sends for the completions:
`TextWithoutImagesGotOcr2Processor` and `TextWithoutImagesPPChart2TableProcessor` tokenize it alone (and take TRL's
images, a list per example, flattened). The Aya Vision, Qianfan-OCR and Ovis 2 processors are the stock classes and
save and reload.
"""

from __future__ import annotations

import math
from dataclasses import replace

from transformers import (
    AyaVisionProcessor,
    GotOcr2ImageProcessorPil,
    GotOcr2Processor,
    InternVLProcessor,
    Ovis2ImageProcessorPil,
    Ovis2Processor,
    PPChart2TableImageProcessorPil,
    PPChart2TableProcessor,
    QianfanOCRProcessor,
)

from trl_padfree.cli.bench.vision import WithoutVideoProcessor

from .common import HEAD_DIM, INIT_STD, SLIDING_WINDOW, TEXT, VISION, TinyFamily, freeze_post_layernorm

# Special tokens, given ids after the shipped tokenizer's 2048
# InternVL's processor reads these names off its tokenizer
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
AYA_TOKENS = ("<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>")
# Ovis 2's processor writes an image as <IMG_START>, its whole image's <IMG_ATOM> tokens, <IMG_GRID>, its tiles'
# (between <IMG_COL> and <IMG_ROW>), <IMG_END>: the model embeds those five indicators from its visual vocabulary
OVIS2_INDICATORS = ("<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>")
OVIS2_TOKENS = ("<image>", "<IMG_ATOM>", *OVIS2_INDICATORS)
# GOT-OCR2's image span: <img>, the image's <imgpad> tokens, </img>
GOT_OCR2_TOKENS = {"start": "<img>", "image_token": "<imgpad>", "end": "</img>"}
GOT_OCR2_TOKENS_PER_TILE = 4  # SAM's 8 x 8 patches of a tile, convolved twice with stride 2

# --- Processors ---------------------------------------------------------------------------------------------------


class TinyInternVLProcessor(WithoutVideoProcessor, InternVLProcessor):
    """`InternVLProcessor` without a video processor."""


def _tiles_processor(model_type, tokenizer, template, image_size=32, max_tiles=4):
    """Images cut into 1 to `max_tiles` tiles of `image_size` pixels, by their aspect ratio, plus a thumbnail of the
    whole image when there are several (GOT-OCR2's image processor); 4 tokens per tile."""
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": image_size, "width": image_size}, crop_to_patches=True, min_patches=1, max_patches=max_tiles
    )
    if model_type == "internvl":
        return TinyInternVLProcessor(
            image_processor, tokenizer, video_processor=None, image_seq_length=4, chat_template=template
        )
    patch_size = image_size // 4  # the tower's patches, 2 x 2 of them per token
    return AyaVisionProcessor(
        image_processor, tokenizer, patch_size=patch_size, img_size=image_size, downsample_factor=2,
        chat_template=template,
    )  # fmt: skip


def _qianfan_ocr_processor(model_type, tokenizer, template, image_size=32, max_tiles=4):
    """As InternVL's (`_tiles_processor`): 1 to `max_tiles` tiles of `image_size` pixels and a thumbnail, 4 tokens
    per tile, written for the template's `<image>`."""
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": image_size, "width": image_size}, crop_to_patches=True, min_patches=1, max_patches=max_tiles
    )
    return QianfanOCRProcessor(image_processor, tokenizer, image_seq_length=4, chat_template=template)


def _ovis2_processor(model_type, tokenizer, template, image_size=32, max_tiles=4, image_seq_length=4):
    """Images cut into 1 to `max_tiles` tiles of `image_size` pixels by their aspect ratio, after the whole image;
    `image_seq_length` tokens per tile."""
    image_processor = Ovis2ImageProcessorPil(
        size={"height": image_size, "width": image_size}, crop_to_patches=True, max_patches=max_tiles
    )
    return Ovis2Processor(image_processor, tokenizer, chat_template=template, image_seq_length=image_seq_length)


class TextWithoutImages:
    """A processor that tokenizes text alone when handed no images, where the stock one refuses it ("You must provide
    valid images"): TRL's vision collator tokenizes the completions so. TRL's images, a list per example, are handed
    on as one list, each image for its placeholder in turn (GOT-OCR2's takes nested lists as one document's pages)."""

    def __call__(self, images=None, text=None, **kwargs):
        if images is None:
            return self.tokenizer(text, **kwargs)
        if images and isinstance(images[0], (list, tuple)):
            images = [image for example in images for image in example]
        return super().__call__(images=images, text=text, **kwargs)


class TextWithoutImagesGotOcr2Processor(TextWithoutImages, GotOcr2Processor):
    """`GotOcr2Processor` that tokenizes text without images; images cut into 1 to 4 tiles and a thumbnail (the
    checkpoints' option, off by default), `GOT_OCR2_TOKENS_PER_TILE` tokens per tile."""

    num_image_tokens = GOT_OCR2_TOKENS_PER_TILE
    images_kwargs = {"crop_to_patches": True, "min_patches": 1, "max_patches": 4}


class TextWithoutImagesPPChart2TableProcessor(TextWithoutImages, PPChart2TableProcessor):
    """`PPChart2TableProcessor` that tokenizes text without images. It writes no image tokens: the chat template writes
    `num_image_tokens` per image."""

    num_image_tokens = GOT_OCR2_TOKENS_PER_TILE


def _got_ocr2_processor(model_type, tokenizer, template, image_size=32):
    """GOT-OCR2: images cut into tiles of `image_size` pixels by their aspect ratio, and a thumbnail when there are
    several; PP-Chart2Table: each image resized to one tile."""
    size = {"height": image_size, "width": image_size}
    if model_type == "pp_chart2table":
        return TextWithoutImagesPPChart2TableProcessor(
            PPChart2TableImageProcessorPil(size=size), tokenizer, chat_template=template
        )
    return TextWithoutImagesGotOcr2Processor(GotOcr2ImageProcessorPil(size=size), tokenizer, chat_template=template)


# --- Configs ------------------------------------------------------------------------------------------------------


def _tiles_config(model_type, processor):
    """InternVL (its own tower, CLS dropped, Qwen2) and Aya Vision (SigLIP, Cohere 2 with a sliding window): each
    tile's 4 x 4 patches pixel-shuffled to 4 tokens."""
    image_size = processor.image_processor.size["height"]
    patch_size = image_size // 4
    if model_type == "internvl":
        return dict(
            text_config=dict(TEXT, model_type="qwen2"),
            vision_config=dict(VISION, image_size=[image_size] * 2, patch_size=[patch_size] * 2),
            image_token_id=processor.image_token_id,
            image_seq_length=processor.image_seq_length,
            downsample_ratio=0.5,
        )
    text = dict(
        TEXT,
        model_type="cohere2",
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(
        VISION,
        model_type="siglip_vision_model",
        image_size=image_size,
        patch_size=patch_size,
        vision_use_head=False,
    )
    return dict(
        text_config=text,
        vision_config=vision,
        image_token_index=processor.image_token_id,
        downsample_factor=2,
        alignment_intermediate_size=64,
    )


def _qianfan_ocr_config(model_type, processor):
    """Qianfan-OCR: InternVL's (`_tiles_config`) with Qwen3 and its tower's stochastic depth off (the checkpoints'
    0.1 would drop different layers in the padded and the packed step)."""
    values = _tiles_config("internvl", processor)
    values["text_config"].update(model_type="qwen3", head_dim=HEAD_DIM)
    values["vision_config"]["drop_path_rate"] = 0.0
    return values


def _ovis2_config(model_type, processor):
    """Ovis 2: each tile's 4 x 4 patches, 2 x 2 per token (`hidden_stride`), scored over a visual vocabulary whose
    embeddings (a softmax-weighted sum) are the token's features; Qwen2."""
    image_size = processor.image_processor.size["height"]
    hidden_stride = 2
    patch_size = image_size // (hidden_stride * math.isqrt(processor.image_seq_length))
    vision = dict(VISION, image_size=image_size, patch_size=patch_size, hidden_stride=hidden_stride, vocab_size=16)
    tokenizer = processor.tokenizer
    return dict(
        text_config=dict(TEXT, model_type="qwen2"),
        vision_config=vision,
        hidden_size=TEXT["hidden_size"],
        vocab_size=len(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_ATOM>"),
        visual_indicator_token_ids=tokenizer.convert_tokens_to_ids(list(OVIS2_INDICATORS)),
    )


def _got_ocr2_config(model_type, processor):
    """GOT-OCR2 (and PP-Chart2Table, its model): SAM over each tile's 8 x 8 patches (windows of 2 x 2, then a global
    layer), its features convolved twice with stride 2 to the processor's 2 x 2 tokens per tile; Qwen2. The tower's
    weights drawn as the others' (its config's 1e-10 would leave it, and its gradients, all but zero)."""
    image_size = processor.image_processor.size["height"]
    patch_size = image_size // (4 * math.isqrt(processor.num_image_tokens))
    vision = dict(
        VISION, image_size=image_size, patch_size=patch_size, window_size=2, global_attn_indexes=[1],
        output_channels=8, mlp_dim=VISION["intermediate_size"], initializer_range=INIT_STD,
    )  # fmt: skip
    return dict(
        text_config=dict(TEXT, model_type="qwen2"),
        vision_config=vision,
        image_token_index=processor.tokenizer.convert_tokens_to_ids(GOT_OCR2_TOKENS["image_token"]),
        image_seq_length=processor.num_image_tokens,
    )


# --- The families -------------------------------------------------------------------------------------------------

# Images cut into tiles of a fixed number of tokens, and a thumbnail
_INTERNVL = TinyFamily(
    tokens=tuple(INTERNVL_TOKENS.values()),
    placeholder=INTERNVL_TOKENS["context_image_token"],
    processor=_tiles_processor,
    config=_tiles_config,
    named_tokens=INTERNVL_TOKENS,
    tags={"before_2026"},
)
# GOT-OCR2's SAM tower runs its own attention: eager, as transformers picks for it
_GOT_OCR2 = TinyFamily(
    tokens=tuple(GOT_OCR2_TOKENS.values()),
    placeholder="".join(GOT_OCR2_TOKENS.values()),
    processor=_got_ocr2_processor,
    config=_got_ocr2_config,
    attention="eager",
    tags={"got_ocr2"},
)

TINY_FAMILIES = {
    "internvl": _INTERNVL,
    "aya_vision": TinyFamily(
        tokens=AYA_TOKENS,
        placeholder="<image>",
        processor=_tiles_processor,
        config=_tiles_config,
        prepare_model=freeze_post_layernorm,
        tags={"before_2026"},
    ),
    # its processor's `image_placeholder_token` <image>, expanded to InternVL's tokens
    "qianfan_ocr": replace(
        _INTERNVL, placeholder="<image>", processor=_qianfan_ocr_processor, config=_qianfan_ocr_config, tags=()
    ),
    "ovis2": TinyFamily(
        tokens=OVIS2_TOKENS,
        placeholder=OVIS2_TOKENS[0],
        processor=_ovis2_processor,
        config=_ovis2_config,
    ),
    "got_ocr2": _GOT_OCR2,
    # PP-Chart2Table's processor expands nothing: its template writes an image's tokens (the checkpoint's, 16 x 16)
    "pp_chart2table": replace(
        _GOT_OCR2,
        placeholder=GOT_OCR2_TOKENS["start"]
        + GOT_OCR2_TOKENS["image_token"] * GOT_OCR2_TOKENS_PER_TILE
        + GOT_OCR2_TOKENS["end"],
    ),
}
