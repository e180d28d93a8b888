"""The families whose processors lay images out by their size (`layout="sized"`): an image's tokens depend on its size,
given in `image_sizes` (or each image's patches with their positions: Gemma 4).

llava_next, llava_onevision (any-resolution tiles: a base tile and a grid of them), granite4_vision (LLaVA-NeXT's
tiles), mistral3 (Pixtral: images of any size), gemma4 and gemma4_unified (images of any size, their patches padded to
a fixed count).

    family          image inputs                                          per-token key (1 on)
    llava_next      pixel_values (I, 5, 3, 32, 32), image_sizes (I, 2)   none (a base tile and up to 2 x 2 tiles)
    llava_onevision as LLaVA-NeXT, and batch_num_images (4,)              none
    granite4_vision as LLaVA-NeXT                                         none (4 tokens per tile, and newlines)
    mistral3        pixel_values (I, 3, 64, 64), image_sizes (I, 2)       none (padded to the largest image)
    gemma4          pixel_values (I, 280, 48), image_position_ids         mm_token_type_ids (soft tokens)
                      (I, 280, 2)                                         (every image's 4-pixel patches padded to 280)
    gemma4_unified  pixel_values (I, 70, 192), image_position_ids         mm_token_type_ids (soft tokens)
                      (I, 70, 2)                                          (2 x 2 patches merged into one, a token each)

    family          config's image id   = processor.image_token_id   tokens per image (default options)
    llava_next(_ov) image_token_index   yes                          16 per tile + a newline per row of tokens
    granite4_vision image_token_index   yes                          as LLaVA-NeXT, 4 per tile
    mistral3        image_token_index   yes                          a [IMG] per merged patch, rows ended by [IMG_BREAK]
    gemma4          image_token_id      yes (its placeholder is      <boi> 56-70 x <image_soft_token> <eoi> (2 x 2
                                        the soft token)              patches each, as many as 70 tokens fit)
    gemma4_unified  image_token_id      yes (as gemma4)              as gemma4 (a merged patch a token)

Departures from the real checkpoints, so that every parameter trains: LLaVA-NeXT, LLaVA-OneVision and Granite 4 Vision
take the vision tower's last layer and freeze its post-layernorm, as LLaVA (tiny_vision.images).

The LLaVA-OneVision and Gemma 4 processors here are subclasses without a video processor (tiny_vision.common).
Pixtral's processor (Mistral 3's) cannot even be imported without torchvision: `StandInPixtralProcessor` writes its
tokens where it is absent; Gemma 4 Unified's image processor needs it too: `StandInGemma4UnifiedImageProcessor`
returns its merged patches. The LLaVA-NeXT and Granite 4 Vision processors are the stock classes and save and reload.
"""

from __future__ import annotations

import math

from transformers import (
    Gemma4AudioFeatureExtractor,
    Gemma4ImageProcessorPil,
    Gemma4Processor,
    Gemma4UnifiedProcessor,
    Granite4VisionProcessor,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    PixtralImageProcessorPil,
    ProcessorMixin,
)

from trl_padfree.cli.bench.vision import WithoutVideoProcessor

from .common import HEAD_DIM, SLIDING_WINDOW, TEXT, VISION, TinyFamily, freeze_post_layernorm

# Special tokens, given ids after the shipped tokenizer's 2048
LLAVA_TOKENS = ("<image>", "<video>")  # LLaVA-OneVision's processor also looks its video token up
GRANITE4_VISION_TOKENS = ("<image>",)
PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
# Gemma 4's processor reads Gemma 3's image tokens and its audio tokens off the tokenizer (it refuses to run without
# boa / eoa)
GEMMA4_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
    "boa_token": "<start_of_audio>",
    "audio_token": "<audio_soft_token>",
    "eoa_token": "<end_of_audio>",
}

# --- Processors ---------------------------------------------------------------------------------------------------


class TinyLlavaOnevisionProcessor(WithoutVideoProcessor, LlavaOnevisionProcessor):
    """`LlavaOnevisionProcessor` without a video processor."""


def _anyres_processor(model_type, tokenizer, template, image_size=32, patch_size=8):
    """Images resized to the best of 1 x 1, 1 x 2, 2 x 1 and 2 x 2 tiles of `image_size`, then cut into those tiles
    after a base tile of the whole image; one token per `patch_size` patch of each tile, a newline token per row."""
    pinpoints = [[image_size * rows, image_size * columns] for rows, columns in ((1, 1), (1, 2), (2, 1), (2, 2))]
    if model_type == "llava_next":  # a CLIP tower: its CLS dropped
        image_processor = LlavaNextImageProcessorPil(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
            image_grid_pinpoints=pinpoints,
        )
        return LlavaNextProcessor(
            image_processor, tokenizer, patch_size=patch_size, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=template,
        )  # fmt: skip
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_grid_pinpoints=pinpoints
    )
    return TinyLlavaOnevisionProcessor(
        image_processor, tokenizer, video_processor=None, num_image_tokens=(image_size // patch_size) ** 2,
        vision_feature_select_strategy="full", chat_template=template,
    )  # fmt: skip


def _granite4_vision_processor(model_type, tokenizer, template, image_size=32, patch_size=8):
    """LLaVA-NeXT's tiles (`_anyres_processor`), each tile's 4 x 4 patches queried by 2 x 2 (`downsample_rate`)."""
    pinpoints = [[image_size * rows, image_size * columns] for rows, columns in ((1, 1), (1, 2), (2, 1), (2, 2))]
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_grid_pinpoints=pinpoints,
    )
    return Granite4VisionProcessor(
        image_processor, tokenizer, patch_size=patch_size, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, downsample_rate="2/4", chat_template=template,
    )  # fmt: skip


class StandInPixtralProcessor(ProcessorMixin):
    """What `PixtralProcessor` (Mistral 3's) writes, where it cannot be imported: its module needs torchvision, absent
    here. Same arguments, the same image processor, and the same tokens: an image's `[IMG]` placeholder becomes a row
    of `[IMG]` per merged patch for each row of them, each row closed by `[IMG_BREAK]`, the last by `[IMG_END]`."""

    def __init__(self, image_processor=None, tokenizer=None, patch_size=16, spatial_merge_size=1, chat_template=None):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.patch_size, self.spatial_merge_size = patch_size, spatial_merge_size
        self.image_token, self.image_break_token, self.image_end_token = PIXTRAL_TOKENS
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)

    def _process_images(self, images, **images_kwargs):
        # images resized to whole merged patches, as Pixtral's processor asks its image processor for
        return super()._process_images(images, **images_kwargs, patch_size=self.patch_size * self.spatial_merge_size)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        token_pixels = self.patch_size * self.spatial_merge_size
        height, width = (int(side) // token_pixels for side in image_inputs["image_sizes"][image_idx])
        text = (self.image_token * width + self.image_break_token) * height
        return text.removesuffix(self.image_break_token) + self.image_end_token


def _pixtral_processor(model_type, tokenizer, template, longest_edge=64, patch_size=8):
    """Images resized to fit `longest_edge` in whole 2 x 2 merged patches of `patch_size`; a token per merged patch.
    transformers' `PixtralProcessor` where torchvision is installed, `StandInPixtralProcessor` otherwise."""
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor as processor_class
    except ImportError:
        processor_class = StandInPixtralProcessor
    image_processor = PixtralImageProcessorPil(size={"longest_edge": longest_edge}, patch_size=patch_size)
    return processor_class(
        image_processor, tokenizer, patch_size=patch_size, spatial_merge_size=2, chat_template=template
    )


class TinyGemma4Processor(WithoutVideoProcessor, Gemma4Processor):
    """`Gemma4Processor` without a video processor."""


class TinyGemma4UnifiedProcessor(WithoutVideoProcessor, Gemma4UnifiedProcessor):
    """`Gemma4UnifiedProcessor` without a video processor."""


class StandInGemma4UnifiedImageProcessor(Gemma4ImageProcessorPil):
    """What `Gemma4UnifiedImageProcessor` returns, where it cannot be built: it needs torchvision, absent here. It
    resizes as Gemma 4's does, then merges each k x k patches (k: pooling_kernel_size) into one patch of their pixels,
    row-major, at the position of its k x k block: which is Gemma 4's PIL processor with patches k times as wide and
    no pooling (PIL's bicubic resize, where the real one uses torchvision's)."""

    def _preprocess(self, images, patch_size, pooling_kernel_size, **kwargs):
        return super()._preprocess(
            images, patch_size=patch_size * pooling_kernel_size, pooling_kernel_size=1, **kwargs
        )


def _gemma4_processor(model_type, tokenizer, template, patch_size=4, pooling_kernel_size=2, max_soft_tokens=70):
    """Images resized, aspect kept, to at most `max_soft_tokens` tokens (the least the image processor takes) of
    `pooling_kernel_size`^2 patches of `patch_size` pixels, each image's patches padded to that most."""
    image_processor = Gemma4ImageProcessorPil(
        patch_size=patch_size, pooling_kernel_size=pooling_kernel_size, max_soft_tokens=max_soft_tokens
    )
    if model_type == "gemma4_unified":  # no vision tower: a token per merged patch
        image_processor = StandInGemma4UnifiedImageProcessor(
            patch_size=patch_size, pooling_kernel_size=pooling_kernel_size, max_soft_tokens=max_soft_tokens
        )
    processor_class = TinyGemma4UnifiedProcessor if model_type == "gemma4_unified" else TinyGemma4Processor
    return processor_class(
        Gemma4AudioFeatureExtractor(), image_processor, tokenizer, video_processor=None, chat_template=template
    )


# --- Configs ------------------------------------------------------------------------------------------------------


def _anyres_config(model_type, processor):
    """LLaVA-NeXT (a CLIP tower, CLS dropped, Llama) and LLaVA-OneVision (a SigLIP tower, Qwen2): the last vision
    layer's patch features of every tile, the processor's tiles."""
    image_processor = processor.image_processor
    image_size = image_processor.size.get("height") or image_processor.crop_size["height"]
    patch_size = (
        processor.patch_size if model_type == "llava_next" else image_size // math.isqrt(processor.num_image_tokens)
    )
    vision = dict(VISION, image_size=image_size, patch_size=patch_size)
    if model_type == "llava_onevision":
        vision.update(model_type="siglip_vision_model", vision_use_head=False)
    values = dict(
        text_config=dict(TEXT),
        vision_config=vision,
        image_token_index=processor.image_token_id,
        image_grid_pinpoints=image_processor.image_grid_pinpoints,
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        vision_feature_layer=-1,  # the real checkpoints' -2 would leave the last vision layer without gradients
    )
    if model_type == "llava_onevision":
        values["text_config"]["model_type"] = "qwen2"
        values["video_token_index"] = processor.tokenizer.convert_tokens_to_ids("<video>")
    return values


_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # the Q-Former's, 0.1 by default


def _granite4_vision_config(model_type, processor):
    """Granite 4 Vision: a CLIP tower (CLS dropped) over LLaVA-NeXT's tiles, its patches queried by Q-Formers in
    windows, the features added to the image tokens before several language model layers (deepstack): one layer's
    from the tower's first layer, then four spatial offsets of its last, each before a layer of its own. The tower is
    64 wide, as its Q-Former takes a head per 64 (Granite4VisionConfig)."""
    image_processor = processor.image_processor
    vision = dict(
        VISION, hidden_size=64, image_size=image_processor.crop_size["height"], patch_size=processor.patch_size
    )
    return dict(
        text_config=dict(TEXT, num_hidden_layers=5),
        vision_config=vision,
        qformer_config=dict(num_hidden_layers=1, intermediate_size=VISION["intermediate_size"], **_NO_DROPOUT),
        image_token_index=processor.image_token_id,
        image_grid_pinpoints=image_processor.image_grid_pinpoints,
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        downsample_rate=processor.downsample_rate,
        deepstack_layer_map=[[1, 0]],
        spatial_target_layers=[1, 2, 3, 4],
        projector_dropout=0.0,
    )


def _mistral3_config(model_type, processor):
    """Mistral 3: a Pixtral tower over images of any size (2-D rotary positions), its patches merged 2 x 2."""
    longest_edge = processor.image_processor.size["longest_edge"]
    vision = dict(VISION, image_size=longest_edge, patch_size=processor.patch_size, head_dim=16)
    return dict(
        text_config=dict(TEXT, head_dim=HEAD_DIM),
        vision_config=vision,
        image_token_index=processor.image_token_id,
        spatial_merge_size=processor.spatial_merge_size,
        vision_feature_layer=-1,
    )


def _gemma4_config(model_type, processor):
    """Gemma 4: a sliding and a full-attention layer (wider heads, as the real ones), per-layer inputs; a vision tower
    over the processor's patches with (x, y) position embeddings, pooled k x k to tokens; no audio tower."""
    image_processor, tokenizer = processor.image_processor, processor.tokenizer
    text = dict(
        TEXT,
        head_dim=HEAD_DIM,
        global_head_dim=2 * HEAD_DIM,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tokenizer),
    )
    patches_per_side = image_processor.max_soft_tokens * image_processor.pooling_kernel_size**2  # a 1-patch-high image
    vision = dict(
        VISION,
        num_key_value_heads=VISION["num_attention_heads"],
        head_dim=VISION["hidden_size"] // VISION["num_attention_heads"],
        patch_size=image_processor.patch_size,
        pooling_kernel_size=image_processor.pooling_kernel_size,
        position_embedding_size=patches_per_side,
    )
    if model_type == "gemma4_unified":  # no tower: merged patches projected, their (x, y) embedded per axis
        del text["hidden_size_per_layer_input"], text["vocab_size_per_layer_input"]
        # Its images see themselves whole past the window: one wider than an image (70 tokens) still cuts text
        text["sliding_window"] = 80
        vision = dict(
            patch_size=image_processor.patch_size,
            pooling_kernel_size=image_processor.pooling_kernel_size,
            mm_embed_dim=VISION["hidden_size"],
            mm_posemb_size=image_processor.max_soft_tokens,
            output_proj_dims=VISION["hidden_size"],
        )
    ids = {name: getattr(tokenizer, f"{name}_id") for name in GEMMA4_TOKENS}
    return dict(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        video_token_id=processor.video_token_id,
        audio_token_id=ids["audio_token"],
        boa_token_id=ids["boa_token"],
        eoa_token_index=ids["eoa_token"],
    )


# --- The families -------------------------------------------------------------------------------------------------

_ANYRES = TinyFamily(
    tokens=LLAVA_TOKENS,
    placeholder="<image>",
    processor=_anyres_processor,
    config=_anyres_config,
    prepare_model=freeze_post_layernorm,
    tags={"before_2026"},
)
_GEMMA4 = TinyFamily(
    tokens=tuple(GEMMA4_TOKENS.values()),
    placeholder=GEMMA4_TOKENS["image_token"],  # expanded to <boi>, the soft tokens, <eoi>
    processor=_gemma4_processor,
    config=_gemma4_config,
    named_tokens=GEMMA4_TOKENS,
)

TINY_FAMILIES = {
    "llava_next": _ANYRES,
    "llava_onevision": _ANYRES,
    "granite4_vision": TinyFamily(
        tokens=GRANITE4_VISION_TOKENS,
        placeholder=GRANITE4_VISION_TOKENS[0],
        processor=_granite4_vision_processor,
        config=_granite4_vision_config,
        prepare_model=freeze_post_layernorm,
    ),
    "mistral3": TinyFamily(
        tokens=PIXTRAL_TOKENS,
        placeholder=PIXTRAL_TOKENS[0],
        processor=_pixtral_processor,
        config=_mistral3_config,
        tags={"before_2026"},
    ),
    "gemma4": _GEMMA4,
    "gemma4_unified": _GEMMA4,
}
