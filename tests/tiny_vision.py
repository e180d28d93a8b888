r"""Tiny vision-language models and matching processors, built in memory with no download, fast on CPU.

    processor = make_vision_processor("qwen2_5_vl")  # the shipped tokenizer + the family's special tokens
    model = make_vision_model("qwen2_5_vl", processor)  # Qwen2_5_VLForConditionalGeneration, random weights
    rows = vision_preference_rows("qwen2_5_vl", 8)  # conversational pairs with noise images, for DPOTrainer

Families (`VISION_FAMILIES`): qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe, glm4v, glm4v_moe,
glm46v, gemma3, llava, vipllava, llava_next, llava_onevision, internvl, aya_vision, mistral3, idefics2, idefics3,
smolvlm, glm_ocr (GLM-4V's layout and GLM-4.6V's processor), paddleocr_vl, kimi_k25 (DeepSeek-V3's language model),
glmga (GLM-4.6V's class and processor), cosmos3_edge, exaone4_5; and `EAGER_FAMILIES`, exact on eager attention only:
hy_v4_vl (a newline token after each merged row of an image). Each
processor uses the PIL image processor transformers ships (no torchvision), tiny images and a chat template
`User:<image> text</s>Assistant: text</s>` whose image part is the processor's placeholder. Models: text width 32,
2 layers, 4 heads, 2 KV heads, vocabulary = the tokenizer's, pad / bos / eos ids 0 / 1 / 2; vision towers of width
32 and 2 layers; geometry read back from the processor. A padded TRL DPO step trains every trainable parameter and,
with policy == reference, starts at ln 2 (qwen3_vl_moe adds its router loss: 0.6931 + 0.001 * aux_loss).

What TRL's `DataCollatorForVisionPreference` makes of 2 default rows: 4 sequences (the chosen, then the rejected),
each family with input_ids, attention_mask and completion_mask of shape (4, L), plus

    family          image inputs                                          per-token key (1 on)
    qwen2_vl        pixel_values (P, 1176), image_grid_thw (4, 3)         mm_token_type_ids (<|image_pad|>)
    qwen2_5_vl      pixel_values (P, 1176), image_grid_thw (4, 3)         mm_token_type_ids (<|image_pad|>)
    qwen3_vl(_moe)  pixel_values (P, 1536), image_grid_thw (4, 3)         mm_token_type_ids (<|image_pad|>)
    gemma3          pixel_values (4, 3, 32, 32)                           token_type_ids (soft tokens)
    llava           pixel_values (4, 3, 32, 32)                           none
    idefics3        pixel_values (4, N, 3, 32, 32), pixel_attention_mask  none
    smolvlm           (4, N, 32, 32), as Idefics3                         none
    llava_next      pixel_values (I, 5, 3, 32, 32), image_sizes (I, 2)   none (a base tile and up to 2 x 2 tiles)
    llava_onevision as LLaVA-NeXT, and batch_num_images (4,)              none
    internvl        pixel_values (tiles, 3, 32, 32)                       none (1-4 tiles and a thumbnail per image)
    aya_vision      pixel_values (tiles, 3, 32, 32)                       none (as InternVL)
    mistral3        pixel_values (I, 3, 64, 64), image_sizes (I, 2)       none (padded to the largest image)
    paddleocr_vl    pixel_values (P, 3, 14, 14), image_grid_thw (4, 3)    mm_token_type_ids (<|IMAGE_PLACEHOLDER|>)
    kimi_k25        pixel_values (P, 3, 14, 14), image_grid_thw (4, 3)    none (plain positions)
    cosmos3_edge    pixel_values (P, 768), image_grid_thw (4, 3)          mm_token_type_ids (<|image_pad|>)
    exaone4_5       pixel_values (P, 1176), image_grid_thw (4, 3)         none (plain positions)

    family          config's image id   = processor.image_token_id   tokens per image (default options)
    qwen*           image_token_id      yes                          1-12 <|image_pad|> in <|vision_start|> ... end
    gemma3          image_token_index   no: the processor's is boi   \n\n <boi> 4 x <image_soft_token> <eoi> \n\n
    llava           image_token_index   yes                          16 <image>
    idefics3        image_token_id      yes                          <fake> <global-img> 4 x <image> <fake>
    smolvlm         image_token_id      yes                          as Idefics3 (12 or 20 <image> if split)
    llava_next(_ov) image_token_index   yes                          16 per tile + a newline per row of tokens
    internvl        image_token_id      yes                          <img> 4 x <IMG_CONTEXT> per tile </img>
    aya_vision      image_token_index   yes                          TILE_k 4 x <|IMG_PATCH|> per tile, in START/END
    mistral3        image_token_index   yes                          a [IMG] per merged patch, rows ended by [IMG_BREAK]
    paddleocr_vl    image_token_id      yes                          1-12 <|IMAGE_PLACEHOLDER|> in <|IMAGE_START|> ... END
    kimi_k25        image_token_id      yes                          1-16 <|media_pad|> in <|media_begin|>image...end

Qwen's P counts 4 patches per image token, each image twice (TRL processes the images for the chosen and again for
the rejected); Idefics3 / SmolVLM pad N, the images per sequence, to the most in a row with all-zero images, which
the model skips. `config.image_token_id` reads the id in every family (`image_token_index` is aliased by LLaVA's and
Gemma 3's attribute_map). Gemma3Processor's `image_token_id` is the begin-of-image token, its text placeholder,
which it expands to the soft tokens the model's `image_token_index` names. Completion padding may hold the eos id
2 rather than 0 (TRL pads with `pad_token_id or eos_token_id`); the masks are 0 there.

Departures from the real checkpoints, so that every parameter trains: LLaVA takes the vision tower's last layer
(`vision_feature_layer=-1`, not -2) and freezes CLIP's post-layernorm, which LLaVA never uses; Gemma 3's tower has no
pooling head (`vision_use_head=False`) and its zero-initialised image projection gets small random values.

Without torchvision there is no video processor: the Qwen-VL, GLM-4V, LLaVA-OneVision, InternVL and SmolVLM processors
here are subclasses that accept `video_processor=None` (SmolVLM's also skips its `num2words` requirement, which only video prompts need). They
handle images and text only, and their `save_pretrained` fails (AttributeError on the missing video processor); train
with `save_strategy="no"`. Pixtral's processor (Mistral 3's) cannot even be imported without torchvision:
`StandInPixtralProcessor` writes its tokens where it is absent; Kimi K2.5's image processor has only a torchvision
backend: `StandInKimiK25ImageProcessor` makes its patches with PIL (its processor, without a video processor, is the
stock class). The Gemma 3, LLaVA, LLaVA-NeXT, Aya Vision and Idefics
processors are the stock classes and save and reload.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AyaVisionProcessor,
    Cosmos3EdgeImageProcessorPil,
    Cosmos3EdgeProcessor,
    Exaone4_5_Processor,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Glm4vImageProcessorPil,
    Glm4vProcessor,
    Glm46VImageProcessorPil,
    Glm46VProcessor,
    GlmgaImageProcessorPil,
    GotOcr2ImageProcessorPil,
    HYV4VLImageProcessorPil,
    HYV4VLProcessor,
    Idefics2ImageProcessorPil,
    Idefics2Processor,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    InternVLProcessor,
    Kimi_K25Processor,
    LlavaImageProcessorPil,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    LlavaProcessor,
    PaddleOCRVLImageProcessorPil,
    PaddleOCRVLProcessor,
    PixtralImageProcessorPil,
    PreTrainedModel,
    ProcessorMixin,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
)
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.processing_utils import ImagesKwargs

from trl_padfree.cli.bench.vision import QWEN_VL_TOKENS, WithoutVideoProcessor
from trl_padfree.data import load_demo_tokenizer

VISION_FAMILIES = (
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe", "glm46v", "gemma3", "llava",
    "vipllava", "llava_next", "llava_onevision", "internvl", "aya_vision", "mistral3", "idefics2",
    "idefics3", "smolvlm", "glm_ocr", "paddleocr_vl",
)  # fmt: skip
VISION_FAMILIES += ("kimi_k25",)
VISION_FAMILIES += ("glmga", "cosmos3_edge")
VISION_FAMILIES += ("exaone4_5",)
# Exact on eager attention only (its sparse indexer reads the attention mask): tests/test_vision.py trains it there
EAGER_FAMILIES = ("hy_v4_vl",)
LLAVA_FAMILIES = ("llava", "vipllava", "llava_next", "llava_onevision")
ANYRES_FAMILIES = ("llava_next", "llava_onevision")  # any-resolution tiles: a base tile and a grid of them
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
MOE_FAMILIES = (
    "qwen3_vl_moe",
    "qwen3_5_moe",
    "glm4v_moe",
)  # a router loss: prefix sharing refused with it (test_moe_aux_loss)
IDEFICS_FAMILIES = ("idefics2", "idefics3", "smolvlm")
TILE_FAMILIES = ("internvl", "aya_vision")  # images cut into tiles of a fixed number of tokens, and a thumbnail

# Special tokens, given ids after the shipped tokenizer's 2048
QWEN_TOKENS = QWEN_VL_TOKENS
GEMMA_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
LLAVA_TOKENS = ("<image>", "<video>")  # LLaVA-OneVision's processor also looks its video token up
# GLM-4V's processor also looks its video tokens up
GLM_FAMILIES = ("glm4v", "glm4v_moe", "glm46v", "glm_ocr")
GLM_FAMILIES += ("glmga",)  # GLM-4.6V's class and processor under another model type
GLM_TOKENS = (
    "<|begin_of_image|>",
    "<|image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|video|>",
    "<|end_of_video|>",
)
# InternVL's processor reads these names off its tokenizer
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
# PaddleOCR-VL's image span; its processor reads the placeholder's name off its tokenizer
PADDLEOCR_TOKENS = {
    "image_start": "<|IMAGE_START|>",
    "image_token": "<|IMAGE_PLACEHOLDER|>",
    "image_end": "<|IMAGE_END|>",
}
# Kimi K2.5's image span (the word `image` between its begin and content tokens); its processor also looks its video
# placeholder up
KIMI_TOKENS = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
)
AYA_TOKENS = ("<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>")
IDEFICS_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    # Tile tags of split images: the processors write `<row_r_col_c>` for a grid of up to 6 x 6 tiles
    *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)),
)
# What the chat template writes for an image part; the processor expands it to the image's tokens
IMAGE_PLACEHOLDERS = {
    **dict.fromkeys(QWEN_FAMILIES, "<|vision_start|><|image_pad|><|vision_end|>"),
    "gemma3": GEMMA_TOKENS["boi_token"],
    **dict.fromkeys(GLM_FAMILIES, "<|begin_of_image|><|image|><|end_of_image|>"),
    **dict.fromkeys(LLAVA_FAMILIES, "<image>"),
    **dict.fromkeys(IDEFICS_FAMILIES, "<image>"),
    "internvl": INTERNVL_TOKENS["context_image_token"],
    "aya_vision": "<image>",
    "mistral3": PIXTRAL_TOKENS[0],
    "paddleocr_vl": "".join(PADDLEOCR_TOKENS.values()),
    "kimi_k25": "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
    "cosmos3_edge": "<|vision_start|><|image_pad|><|vision_end|>",
    "exaone4_5": "<|vision_start|><|image_pad|><|vision_end|>",
    "hy_v4_vl": "<|vision_start|><|image_pad|><|vision_end|>",
}
_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize }}:"
    "{%- if message['content'] is string %} {{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '@IMAGE@' }}"
    "{%- elif part['type'] == 'text' %} {{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ eos_token }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}"
)

# Model shapes: the width of trl_padfree.tiny's decoders, and a vision tower just as small
_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_HEAD_DIM = _TEXT["hidden_size"] // _TEXT["num_attention_heads"]
_MROPE_SECTION = [2, 1, 1]  # temporal, height, width: sums to head_dim / 2
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
_INIT_STD = 0.02  # the configs' initializer_range
_SLIDING_WINDOW = 6  # shorter than every sequence, so Gemma 3's window really cuts


def vision_chat_template(model_type: str) -> str:
    """`User:<image> text</s>Assistant: text</s>`, with `<image>` the processor's placeholder for `model_type`."""
    return _CHAT_TEMPLATE.replace("@IMAGE@", IMAGE_PLACEHOLDERS[model_type])


# --- Tokenizer and processors -------------------------------------------------------------------------------------


def make_vision_tokenizer(model_type: str):
    """The shipped tokenizer (`trl_padfree.data.load_demo_tokenizer`) with `model_type`'s special tokens added."""
    _check_family(model_type)
    tokenizer = load_demo_tokenizer()
    if model_type in QWEN_FAMILIES:
        tokens = QWEN_TOKENS
    elif model_type == "gemma3":
        tokens = tuple(GEMMA_TOKENS.values())
    elif model_type in LLAVA_FAMILIES:
        tokens = LLAVA_TOKENS
    elif model_type in GLM_FAMILIES:
        tokens = GLM_TOKENS
    elif model_type == "internvl":
        tokens = tuple(INTERNVL_TOKENS.values())
    elif model_type == "aya_vision":
        tokens = AYA_TOKENS
    elif model_type == "mistral3":
        tokens = PIXTRAL_TOKENS
    elif model_type == "paddleocr_vl":
        tokens = tuple(PADDLEOCR_TOKENS.values())
    elif model_type == "kimi_k25":
        tokens = KIMI_TOKENS
    elif model_type == "cosmos3_edge":
        tokens = QWEN_TOKENS
    elif model_type in ("exaone4_5", "hy_v4_vl"):
        tokens = QWEN_TOKENS
    else:
        tokens = IDEFICS_TOKENS
    tokenizer.add_special_tokens({"extra_special_tokens": list(tokens)}, replace_extra_special_tokens=False)
    if model_type == "gemma3":
        # Gemma3Processor reads `tokenizer.boi_token`, `.image_token`, `.eoi_token` and their ids; the named
        # model-specific tokens are how a Gemma 3 checkpoint's tokenizer config declares them
        tokenizer._set_model_specific_special_tokens(GEMMA_TOKENS)
    if model_type == "internvl":
        tokenizer._set_model_specific_special_tokens(INTERNVL_TOKENS)
    if model_type == "paddleocr_vl":
        tokenizer._set_model_specific_special_tokens({"image_token": PADDLEOCR_TOKENS["image_token"]})
    return tokenizer


class TinyQwen2VLProcessor(WithoutVideoProcessor, Qwen2VLProcessor):
    """`Qwen2VLProcessor` without a video processor."""


class TinyQwen2_5_VLProcessor(WithoutVideoProcessor, Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` without a video processor."""


class TinyQwen3VLProcessor(WithoutVideoProcessor, Qwen3VLProcessor):
    """`Qwen3VLProcessor` without a video processor."""


class TinyGlm4vProcessor(WithoutVideoProcessor, Glm4vProcessor):
    """`Glm4vProcessor` without a video processor."""


class TinyGlm46VProcessor(WithoutVideoProcessor, Glm46VProcessor):
    """`Glm46VProcessor` without a video processor."""


class TinyLlavaOnevisionProcessor(WithoutVideoProcessor, LlavaOnevisionProcessor):
    """`LlavaOnevisionProcessor` without a video processor."""


class TinyInternVLProcessor(WithoutVideoProcessor, InternVLProcessor):
    """`InternVLProcessor` without a video processor."""


class TinySmolVLMProcessor(WithoutVideoProcessor, SmolVLMProcessor):
    """`SmolVLMProcessor` without a video processor, nor `num2words` (absent here, and only video prompts use it)."""

    def __init__(self, image_processor, tokenizer, video_processor=None, image_seq_len=169, chat_template=None):
        # SmolVLMProcessor.__init__ raises ImportError without num2words: set what it sets, then skip it
        self.fake_image_token = "<fake_token_around_image>"
        self.image_token = "<image>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.end_of_utterance_token = "<end_of_utterance>"
        self.global_image_token = "<global-img>"
        self.image_seq_len = image_seq_len
        self.video_token = "<video>"
        ProcessorMixin.__init__(self, image_processor, tokenizer, video_processor, chat_template=chat_template)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        # SmolVLM's own reads the video processor's frame defaults
        return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)


_QWEN_PROCESSORS = {
    "qwen2_vl": TinyQwen2VLProcessor,
    "qwen2_5_vl": TinyQwen2_5_VLProcessor,
    "qwen3_vl": TinyQwen3VLProcessor,
    "qwen3_vl_moe": TinyQwen3VLProcessor,
    "qwen3_5": TinyQwen3VLProcessor,  # Qwen3.5's checkpoints ship Qwen3-VL's processor
    "qwen3_5_moe": TinyQwen3VLProcessor,
}


def _qwen_processor(model_type, tokenizer, template, min_pixels=None, max_pixels=None):
    """Images resized to 1 to 12 merged patches (image tokens) unless `min_pixels` / `max_pixels` say otherwise."""
    patch_size = 16 if model_type.startswith("qwen3") else 14  # Qwen3-VL's tower uses 16-pixel patches
    token_pixels = (2 * patch_size) ** 2  # one image token: 2 x 2 patches, merged
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=min_pixels or token_pixels,
        max_pixels=max_pixels or 12 * token_pixels,
    )
    processor_class = _QWEN_PROCESSORS[model_type]
    return processor_class(image_processor, tokenizer, video_processor=None, chat_template=template)


def _glm4v_processor(model_type, tokenizer, template):
    """Images resized to 1 to 12 merged patches (image tokens), as `_qwen_processor`'s: GLM-4V lays its images out
    as Qwen2-VL does."""
    token_pixels = (2 * 14) ** 2  # one image token: 2 x 2 patches of 14 pixels, merged
    # GLM-OCR's checkpoint ships GLM-4.6V's processor
    image_processor_class = Glm46VImageProcessorPil if model_type in ("glm46v", "glm_ocr") else Glm4vImageProcessorPil
    image_processor = image_processor_class(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": token_pixels, "longest_edge": 12 * token_pixels},
    )
    processor_class = (
        TinyGlm46VProcessor if model_type in ("glm46v", "glm_ocr") else TinyGlm4vProcessor
    )  # GLM-4V-MoE ships GLM-4V's
    return processor_class(image_processor, tokenizer, video_processor=None, chat_template=template)


def _glmga_processor(model_type, tokenizer, template):
    """GLM-4.6V's processor over GLMGA's image processor (GLM-4.6V's, its sides also multiples of
    `patch_expand_factor`, 1 by default): images resized to 1 to 12 merged patches, as `_glm4v_processor`'s."""
    token_pixels = (2 * 14) ** 2
    image_processor = GlmgaImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": token_pixels, "longest_edge": 12 * token_pixels},
    )  # fmt: skip
    return TinyGlm46VProcessor(image_processor, tokenizer, video_processor=None, chat_template=template)


def _paddleocr_processor(model_type, tokenizer, template):
    """Images resized to 1 to 12 merged patches (image tokens) of 14-pixel patches, each patch (3, 14, 14)."""
    token_pixels = (2 * 14) ** 2  # one image token: 2 x 2 patches, merged
    image_processor = PaddleOCRVLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=1, min_pixels=token_pixels, max_pixels=12 * token_pixels
    )
    return PaddleOCRVLProcessor(image_processor, tokenizer, chat_template=template)


class StandInKimiK25ImageProcessorKwargs(ImagesKwargs, total=False):
    max_patches: int
    patch_size: int
    merge_size: int


class StandInKimiK25ImageProcessor(PilBackend):
    """What `Kimi_K25ImageProcessor` makes, where it cannot be imported: it has only a torchvision backend, absent
    here. The same steps (transformers 5.24's image_processing_kimi_k25.py): each image shrunk, never enlarged, to at
    most `max_patches` patches and `size["max_height"]` patches a side, padded with zeros at its bottom and right to
    whole merged patches, rescaled and normalised; `pixel_values` every image's patches, each `(3, patch, patch)`, row
    by row, and `image_grid_thw` `(1, rows, columns)` in patches."""

    resample = PILImageResampling.BICUBIC
    size = {"max_height": 512, "max_width": 512}
    max_patches = 16384
    patch_size = 14
    merge_size = 2
    do_resize = do_rescale = do_normalize = do_convert_rgb = True
    image_mean, image_std = IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
    valid_kwargs = StandInKimiK25ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]

    def _preprocess(self, images, do_resize, size, resample, do_rescale, rescale_factor, do_normalize, image_mean,
                    image_std, patch_size, merge_size, max_patches, return_tensors, **kwargs):  # fmt: skip
        patches, grids = [], []
        for image in images:
            if do_resize:
                shrunk, padded = _kimi_sizes(*image.shape[-2:], patch_size, merge_size, max_patches, size.max_height)
                image = self.resize(image, SizeDict(height=shrunk[0], width=shrunk[1]), resample=resample)
                image = self.pad([image], pad_size=SizeDict(height=padded[0], width=padded[1]))[0]
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            channels, height, width = image.shape
            rows, columns = height // patch_size, width // patch_size
            grid = image.reshape(channels, rows, patch_size, columns, patch_size).transpose(1, 3, 0, 2, 4)
            patches.append(grid.reshape(rows * columns, channels, patch_size, patch_size))
            grids.append([1, rows, columns])
        data = {"pixel_values": np.concatenate(patches), "image_grid_thw": np.array(grids, dtype=np.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)


def _kimi_sizes(height, width, patch_size, merge_size, max_patches, max_patches_per_side):
    """Kimi K2.5's `navit_resize`: the shrunk size of an image, and that size padded to whole merged patches."""
    patches = max(1, height // patch_size) * max(1, width // patch_size)
    side = max_patches_per_side * patch_size
    scale = min(1.0, math.sqrt(max_patches / patches), side / height, side / width)
    shrunk = [min(max(1, int(length * scale)), side) for length in (height, width)]
    factor = merge_size * patch_size
    return shrunk, [length + (factor - length % factor) % factor for length in shrunk]


class TinyKimiK25Processor(WithoutVideoProcessor, Kimi_K25Processor):
    """`Kimi_K25Processor` without a video processor."""


class TinyCosmos3EdgeProcessor(WithoutVideoProcessor, Cosmos3EdgeProcessor):
    """`Cosmos3EdgeProcessor` without a video processor, returning `mm_token_type_ids`: transformers 5.24's leaves them
    off (its model then raises on images), so a user sets `processor.return_mm_token_type_ids = True`."""

    return_mm_token_type_ids = True


def _cosmos3_edge_processor(model_type, tokenizer, template):
    """Images resized to 1 to 12 merged patches (image tokens) of 16-pixel patches, one frame each."""
    token_pixels = (2 * 16) ** 2  # one image token: 2 x 2 patches, merged
    image_processor = Cosmos3EdgeImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=1,
        size={"shortest_edge": token_pixels, "longest_edge": 12 * token_pixels},
    )  # fmt: skip
    return TinyCosmos3EdgeProcessor(image_processor, tokenizer, video_processor=None, chat_template=template)


class TinyExaone4_5_Processor(WithoutVideoProcessor, Exaone4_5_Processor):
    """`Exaone4_5_Processor` without a video processor."""


def _exaone4_5_processor(model_type, tokenizer, template):
    """Qwen2-VL's image processor (EXAONE 4.5's checkpoints ship it): images resized to 1 to 12 merged patches."""
    token_pixels = (2 * 14) ** 2  # one image token: 2 x 2 patches of 14 pixels, merged
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=token_pixels, max_pixels=12 * token_pixels
    )
    return TinyExaone4_5_Processor(image_processor, tokenizer, video_processor=None, chat_template=template)


class TinyHYV4VLProcessor(WithoutVideoProcessor, HYV4VLProcessor):
    """`HYV4VLProcessor` without a video processor."""


def _hy_v4_vl_processor(model_type, tokenizer, template):
    """Images resized to 1 to 12 merged patches of 16-pixel patches, one frame each; a newline token after each row
    of merged patches: up to 18 image tokens."""
    token_pixels = (2 * 16) ** 2
    image_processor = HYV4VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=1, min_pixels=token_pixels, max_pixels=12 * token_pixels
    )
    return TinyHYV4VLProcessor(image_processor, tokenizer, video_processor=None, chat_template=template)


def _kimi_processor(model_type, tokenizer, template, max_patches=48):
    """Images shrunk to at most `max_patches` patches of 14 pixels (12 merged 2 x 2), padded to whole merged patches:
    up to 16 image tokens; the stand-in image processor (`StandInKimiK25ImageProcessor`) without torchvision."""
    image_processor = StandInKimiK25ImageProcessor(
        patch_size=14, merge_size=2, max_patches=max_patches, size={"max_height": 12, "max_width": 12}
    )
    return TinyKimiK25Processor(image_processor, tokenizer, video_processor=None, chat_template=template)


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


def _idefics_processor(model_type, tokenizer, template, image_size=32, image_seq_len=4, do_image_splitting=False):
    """Images resized to `image_size` squares, `image_seq_len` tokens each; split into tiles of `image_size` (up to
    2 x 2, plus the whole image) only with `do_image_splitting`."""
    if model_type == "idefics2":  # whole images resized to fit `image_size`, `image_seq_len` resampled tokens each
        image_processor = Idefics2ImageProcessorPil(
            size={"longest_edge": image_size, "shortest_edge": image_size}, do_image_splitting=do_image_splitting
        )
        return Idefics2Processor(image_processor, tokenizer, image_seq_len=image_seq_len, chat_template=template)
    image_processor_class = Idefics3ImageProcessorPil if model_type == "idefics3" else SmolVLMImageProcessorPil
    image_processor = image_processor_class(
        size={"longest_edge": 2 * image_size if do_image_splitting else image_size},
        max_image_size={"longest_edge": image_size},
        do_image_splitting=do_image_splitting,
    )
    if model_type == "idefics3":
        return Idefics3Processor(image_processor, tokenizer, image_seq_len=image_seq_len, chat_template=template)
    return TinySmolVLMProcessor(image_processor, tokenizer, image_seq_len=image_seq_len, chat_template=template)


_PROCESSOR_BUILDERS = {
    **dict.fromkeys(QWEN_FAMILIES, _qwen_processor),
    **dict.fromkeys(GLM_FAMILIES, _glm4v_processor),
    "gemma3": _gemma3_processor,
    **dict.fromkeys(("llava", "vipllava"), _llava_processor),  # VipLLaVA's checkpoints ship LLaVA's processor
    **dict.fromkeys(ANYRES_FAMILIES, _anyres_processor),
    **dict.fromkeys(TILE_FAMILIES, _tiles_processor),
    "mistral3": _pixtral_processor,
    "paddleocr_vl": _paddleocr_processor,
    "kimi_k25": _kimi_processor,
    "glmga": _glmga_processor,
    "cosmos3_edge": _cosmos3_edge_processor,
    "exaone4_5": _exaone4_5_processor,
    "hy_v4_vl": _hy_v4_vl_processor,
    **dict.fromkeys(IDEFICS_FAMILIES, _idefics_processor),
}


def make_vision_processor(model_type: str, chat_template: str | None = None, **options) -> ProcessorMixin:
    """A processor for `model_type` over the shipped tokenizer, with tiny images and a chat template.

    `options` go to the family's builder: `min_pixels` / `max_pixels` (Qwen), `image_size` and `image_seq_length`
    (Gemma 3), `image_size` and `patch_size` (LLaVA), `image_size`, `image_seq_len` and `do_image_splitting`
    (Idefics3, SmolVLM). `make_vision_model` reads the image geometry back from the processor.
    """
    _check_family(model_type)
    tokenizer = make_vision_tokenizer(model_type)
    template = chat_template if chat_template is not None else vision_chat_template(model_type)
    return _PROCESSOR_BUILDERS[model_type](model_type, tokenizer, template, **options)


# --- Models -------------------------------------------------------------------------------------------------------


def _patch_model(image_processor) -> tuple[dict, dict]:
    """The text and vision configs of a Qwen2-VL-like model: multimodal RoPE over 3 sections, and a tower over the
    processor's patches, merged 2 x 2."""
    text = dict(_TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=_MROPE_SECTION))
    vision = dict(
        depth=_VISION["num_hidden_layers"],
        num_heads=_VISION["num_attention_heads"],
        patch_size=image_processor.patch_size,
        spatial_merge_size=image_processor.merge_size,
        temporal_patch_size=image_processor.temporal_patch_size,
    )
    return text, vision


def _qwen_config(model_type, processor):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL (MoE), Qwen3.5 (MoE)."""
    image_processor = processor.image_processor
    tokenizer = processor.tokenizer
    text, vision = _patch_model(image_processor)
    if model_type == "qwen2_vl":
        vision.update(embed_dim=_VISION["hidden_size"], hidden_size=_TEXT["hidden_size"], mlp_ratio=2)
    else:
        vision.update(
            hidden_size=_VISION["hidden_size"],
            intermediate_size=_VISION["intermediate_size"],
            out_hidden_size=_TEXT["hidden_size"],
        )
    if model_type == "qwen2_5_vl":
        # Windows of 2 x 2 merged patches in block 0, full attention in block 1
        vision.update(
            window_size=2 * image_processor.merge_size * image_processor.patch_size, fullatt_block_indexes=[1]
        )
    if model_type.startswith("qwen3"):
        text.update(head_dim=_HEAD_DIM)
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])  # a 4 x 4 grid of learned positions
    if model_type == "qwen3_vl_moe":
        # experts narrower than the model: a checkpoint in the hub's layout is transposed on load (save_vision_models)
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
    if model_type == "qwen3_5_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if model_type.startswith("qwen3_5"):  # a gated delta-net layer, then a gated attention layer
        text.update(
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8,
        )  # fmt: skip
    start_id, end_id, image_id, video_id = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    return dict(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
        image_token_id=image_id,
        video_token_id=video_id,
    )


def _glm4v_config(model_type, processor):
    """GLM-4V, GLM-4.5V (MoE) and GLM-4.6V: Qwen2-VL-like (`_patch_model`), a 2 x 2 grid of learned positions."""
    tokenizer = processor.tokenizer
    text, vision = _patch_model(processor.image_processor)
    vision.update(
        hidden_size=_VISION["hidden_size"],
        intermediate_size=_VISION["intermediate_size"],
        out_hidden_size=_TEXT["hidden_size"],
        image_size=28,
    )
    if model_type == "glm4v_moe":  # a dense first layer, then 4 routed experts and a shared one
        # Rotary on half of each head (the checkpoints' partial_rotary_factor): heads twice as wide keep 3 sections
        text["rope_parameters"]["partial_rotary_factor"] = 0.5
        text.update(
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, head_dim=2 * _HEAD_DIM,
        )  # fmt: skip
    ids = dict(zip(GLM_TOKENS, tokenizer.convert_tokens_to_ids(list(GLM_TOKENS)), strict=True))
    return dict(
        text_config=text,
        vision_config=vision,
        image_start_token_id=ids["<|begin_of_image|>"],
        image_token_id=ids["<|image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_token_id=ids["<|video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
    )


def _paddleocr_config(model_type, processor):
    """PaddleOCR-VL: a SigLIP-like tower over the processor's patches (learned positions resampled to each image's
    grid), merged 2 x 2 by its projector; ERNIE-4.5's language model with 3-section mRoPE."""
    tokenizer = processor.tokenizer
    image_processor = processor.image_processor
    text = dict(
        _TEXT, head_dim=_HEAD_DIM,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=_MROPE_SECTION),
    )  # fmt: skip
    vision = dict(
        _VISION, patch_size=image_processor.patch_size, spatial_merge_size=image_processor.merge_size, image_size=56
    )
    start_id, image_id, end_id = tokenizer.convert_tokens_to_ids(list(PADDLEOCR_TOKENS.values()))
    return dict(
        text_config=text,
        vision_config=vision,
        image_token_id=image_id,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
    )


def _kimi_config(model_type, processor):
    """Kimi K2.5: MoonViT over the processor's patches (learned positions resampled to each image's grid, 2-D rotary),
    merged 2 x 2 by its projector; DeepSeek-V3's language model (latent attention, a dense first layer, then 4 routed
    experts and a shared one), plain text positions."""
    tokenizer = processor.tokenizer
    image_processor = processor.image_processor
    text = dict(
        _TEXT, model_type="deepseek_v3", num_key_value_heads=_TEXT["num_attention_heads"], kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1,
    )  # fmt: skip
    vision = dict(
        _VISION, patch_size=image_processor.patch_size, merge_kernel_size=[image_processor.merge_size] * 2,
        pos_emb_height=8, pos_emb_width=8,
    )  # fmt: skip
    begin_id, _, end_id, image_id, video_id = tokenizer.convert_tokens_to_ids(list(KIMI_TOKENS))
    return dict(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=_VISION["hidden_size"],  # the projector's norm, over the tower's features
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=begin_id,
        vision_end_token_id=end_id,
    )


def _cosmos3_edge_config(model_type, processor):
    """Cosmos3 Edge: a SigLIP-like tower over the processor's patches (a 4 x 4 grid of learned positions resampled to
    each image's), merged 2 x 2 by its projector; a language model with 3-section mRoPE."""
    tokenizer = processor.tokenizer
    image_processor = processor.image_processor
    text = dict(
        _TEXT, head_dim=_HEAD_DIM,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=_MROPE_SECTION),
    )  # fmt: skip
    vision = dict(
        _VISION, patch_size=image_processor.patch_size, spatial_merge_size=image_processor.merge_size, num_patches=16
    )
    start_id, end_id, image_id, video_id = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    return dict(
        text_config=text,
        vision_config=vision,
        projector_hidden_size=64,
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
    )


def _exaone4_5_config(model_type, processor):
    """EXAONE 4.5: Qwen2.5-VL's tower (windows of 2 x 2 merged patches in block 0, full attention in block 1, grouped
    key-value heads) over the processor's patches; EXAONE 4's language model (a sliding-window layer, then a full one),
    plain text positions."""
    image_processor = processor.image_processor
    _, vision = _patch_model(image_processor)
    vision.update(
        hidden_size=_VISION["hidden_size"], intermediate_size=_VISION["intermediate_size"], num_key_value_heads=1,
        out_hidden_size=_TEXT["hidden_size"], window_size=2 * image_processor.merge_size * image_processor.patch_size,
        fullatt_block_indexes=[1],
    )  # fmt: skip
    _, _, image_id, video_id = processor.tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    return dict(
        text_config=dict(
            _TEXT,
            model_type="exaone4",
            head_dim=_HEAD_DIM,
            sliding_window=_SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),  # fmt: skip
        vision_config=vision,
        image_token_id=image_id,
        video_token_id=video_id,
    )


def _hy_v4_vl_config(model_type, processor):
    """HY-V4-VL: its tower over the processor's patches, merged 2 x 2, a learned newline after each merged row; HY-V4's
    language model (latent attention with a sparse indexer of top-16 keys, hyper-connections, a dense layer then 4
    routed experts and a shared one), 3-section mRoPE over the latent attention's rope part."""
    image_processor = processor.image_processor
    text = dict(
        _TEXT, num_key_value_heads=_TEXT["num_attention_heads"], moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=2 * sum(_MROPE_SECTION), v_head_dim=8, index_topk=16, index_head_dim=8, index_n_heads=8,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=_MROPE_SECTION),
    )  # fmt: skip
    vision = dict(
        _VISION, out_hidden_size=_TEXT["hidden_size"], patch_size=image_processor.patch_size,
        spatial_merge_size=image_processor.merge_size,
    )  # fmt: skip
    _, _, image_id, video_id = processor.tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    return dict(text_config=text, vision_config=vision, image_token_id=image_id, video_token_id=video_id)


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
        _TEXT,
        head_dim=_HEAD_DIM,
        query_pre_attn_scalar=_HEAD_DIM,
        sliding_window=_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(
        _VISION, image_size=image_size, patch_size=image_size // (2 * tokens_per_side), vision_use_head=False
    )
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
    vision = dict(
        _VISION, image_size=image_size, patch_size=processor.patch_size, projection_dim=_VISION["hidden_size"]
    )
    return dict(
        text_config=dict(_TEXT),
        vision_config=vision,
        image_token_index=processor.image_token_id,
        image_seq_length=(image_size // processor.patch_size) ** 2,
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        vision_feature_layer=-1,  # the real checkpoints' -2 would leave the last vision layer without gradients
    )


def _vipllava_config(model_type, processor):
    """VipLLaVA: LLaVA whose projector reads the patch features (CLS dropped) of several vision layers, here both."""
    values = _llava_config(model_type, processor)
    del values["vision_feature_select_strategy"], values["vision_feature_layer"]
    return values | dict(vision_feature_layers=[-1, 0])


def _anyres_config(model_type, processor):
    """LLaVA-NeXT (a CLIP tower, CLS dropped, Llama) and LLaVA-OneVision (a SigLIP tower, Qwen2): the last vision
    layer's patch features of every tile, the processor's tiles."""
    image_processor = processor.image_processor
    image_size = image_processor.size.get("height") or image_processor.crop_size["height"]
    patch_size = (
        processor.patch_size if model_type == "llava_next" else image_size // math.isqrt(processor.num_image_tokens)
    )
    vision = dict(_VISION, image_size=image_size, patch_size=patch_size)
    if model_type == "llava_onevision":
        vision.update(model_type="siglip_vision_model", vision_use_head=False)
    values = dict(
        text_config=dict(_TEXT),
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


def _tiles_config(model_type, processor):
    """InternVL (its own tower, CLS dropped, Qwen2) and Aya Vision (SigLIP, Cohere 2 with a sliding window): each
    tile's 4 x 4 patches pixel-shuffled to 4 tokens."""
    image_size = processor.image_processor.size["height"]
    patch_size = image_size // 4
    if model_type == "internvl":
        return dict(
            text_config=dict(_TEXT, model_type="qwen2"),
            vision_config=dict(_VISION, image_size=[image_size] * 2, patch_size=[patch_size] * 2),
            image_token_id=processor.image_token_id,
            image_seq_length=processor.image_seq_length,
            downsample_ratio=0.5,
        )
    text = dict(
        _TEXT,
        model_type="cohere2",
        sliding_window=_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(
        _VISION,
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


def _mistral3_config(model_type, processor):
    """Mistral 3: a Pixtral tower over images of any size (2-D rotary positions), its patches merged 2 x 2."""
    longest_edge = processor.image_processor.size["longest_edge"]
    vision = dict(_VISION, image_size=longest_edge, patch_size=processor.patch_size, head_dim=16)
    return dict(
        text_config=dict(_TEXT, head_dim=_HEAD_DIM),
        vision_config=vision,
        image_token_index=processor.image_token_id,
        spatial_merge_size=processor.spatial_merge_size,
        vision_feature_layer=-1,
    )


def _idefics2_config(model_type, processor):
    """Idefics2: patch features resampled by a perceiver to the processor's `image_seq_len` latent tokens."""
    image_size = processor.image_processor.size["longest_edge"]
    return dict(
        text_config=dict(_TEXT),
        vision_config=dict(_VISION, image_size=image_size, patch_size=image_size // 4),
        perceiver_config=dict(
            hidden_size=_TEXT["hidden_size"], resampler_n_latents=processor.image_seq_len, resampler_depth=1,
            resampler_n_heads=2, resampler_head_dim=8, num_key_value_heads=1,
        ),
        image_token_id=processor.image_token_id,
    )  # fmt: skip


def _idefics_config(model_type, processor):
    """Idefics3 / SmolVLM: patch features pixel-shuffled by `scale_factor` 2 into the processor's `image_seq_len`."""
    image_size = processor.image_processor.max_image_size["longest_edge"]
    scale_factor = 2
    tokens_per_side = math.isqrt(processor.image_seq_len)
    patch_size = image_size // (tokens_per_side * scale_factor)
    if tokens_per_side**2 != processor.image_seq_len or patch_size * tokens_per_side * scale_factor != image_size:
        raise ValueError(f"image_seq_len {processor.image_seq_len} does not tile {image_size}-pixel images")
    return dict(
        text_config=dict(_TEXT),
        vision_config=dict(_VISION, image_size=image_size, patch_size=patch_size),
        image_token_id=processor.image_token_id,
        scale_factor=scale_factor,
    )


_CONFIG_BUILDERS = {
    **dict.fromkeys(QWEN_FAMILIES, _qwen_config),
    **dict.fromkeys(GLM_FAMILIES, _glm4v_config),
    "gemma3": _gemma3_config,
    "llava": _llava_config,
    "vipllava": _vipllava_config,
    **dict.fromkeys(ANYRES_FAMILIES, _anyres_config),
    **dict.fromkeys(TILE_FAMILIES, _tiles_config),
    "mistral3": _mistral3_config,
    "paddleocr_vl": _paddleocr_config,
    "kimi_k25": _kimi_config,
    "cosmos3_edge": _cosmos3_edge_config,
    "exaone4_5": _exaone4_5_config,
    "hy_v4_vl": _hy_v4_vl_config,
    "idefics2": _idefics2_config,
    **dict.fromkeys(("idefics3", "smolvlm"), _idefics_config),
}


def make_vision_config(model_type: str, processor: ProcessorMixin, **config_overrides):
    """The tiny config of `model_type`, consistent with `processor` (token ids, vocabulary, image geometry).

    `config_overrides` set top-level fields; `text_config=` and `vision_config=` dicts are merged into the sub-configs.
    """
    _check_family(model_type)
    values = _CONFIG_BUILDERS[model_type](model_type, processor)
    values["text_config"]["vocab_size"] = len(processor.tokenizer)
    for key in ("text_config", "vision_config"):
        values[key].update(config_overrides.pop(key, {}))
    return AutoConfig.for_model(model_type, **values, **config_overrides)


def make_vision_model(
    model_type: str,
    processor: ProcessorMixin,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **config_overrides,
) -> PreTrainedModel:
    """A randomly initialised tiny `<Family>ForConditionalGeneration` matching `processor`, the same weights for the
    same seed; see `make_vision_config` for `config_overrides`."""
    config = make_vision_config(model_type, processor, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    if model_type == "gemma3":
        # Gemma 3 initialises its image projection to zero, which would cut every gradient to the vision tower
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=_INIT_STD)
    if model_type in ("llava", "aya_vision", *ANYRES_FAMILIES):
        # LLaVA takes the tower's hidden states, before its post-layernorm: freeze it, as it gets no gradient
        tower = model.model.vision_tower
        getattr(tower, "vision_model", tower).post_layernorm.requires_grad_(False)
    model.config.name_or_path = f"tiny-{model_type}"
    return model


def save_vision_models(directory, families) -> None:
    """Each family's model in `<directory>/<family>`, with its processor where it saves and `AutoProcessor` loads it back
    as itself (not so without a video processor, or for a stand-in, whose folder AutoProcessor reads as a tokenizer):
    tests/distributed/train_dpo.py builds the others again."""
    from pathlib import Path

    from transformers import AutoProcessor

    directory = Path(directory)
    for model_type in families:
        processor = make_vision_processor(model_type)
        make_vision_model(model_type, processor).save_pretrained(directory / model_type)
        if model_type == "qwen3_vl_moe":
            save_experts_in_hub_layout(directory / model_type)
        scratch = directory / "processors" / model_type
        try:
            processor.save_pretrained(scratch)
        except AttributeError:  # no video processor here
            continue
        if type(AutoProcessor.from_pretrained(scratch)) is type(processor):
            processor.save_pretrained(directory / model_type)


def save_experts_in_hub_layout(model_dir) -> None:
    """Rewrite a saved Qwen3-VL-MoE's expert weights as the hub's checkpoints hold them, (experts, in, out), which
    transformers transposes on load. Saved in its own layout, the checkpoint loads under DeepSpeed ZeRO-3's zero.Init
    with a size error (transformers 5.23-5.24 compares the partitioned parameter's empty shape, so it always transposes;
    docs/guides/long-sequences.md), as a user's own saved Qwen3-VL-MoE would."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


# --- Data ---------------------------------------------------------------------------------------------------------

# Sizes (height, width) that give Qwen 1 to 12 image tokens, and odd aspect ratios to the square-resizing families
IMAGE_SIZES = ((28, 28), (56, 84), (84, 56), (45, 61), (100, 30), (64, 64), (33, 97), (90, 90), (84, 112))
_WORDS = (
    "the a cat dog red blue small large house tree river sky what is this picture shows colour shape left right "
    "near far bright dark noise pixel square round many few one two three green yellow under over next to behind"
).split()


def make_image(height: int, width: int, seed: int) -> Image.Image:
    """An RGB image of uniform random noise, the same for the same seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def _sentence(rng: random.Random, length: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(length))


def vision_preference_rows(
    model_type: str,
    count: int,
    seed: int = 0,
    images_per_row: int | Sequence[int] = 1,
    sizes: Sequence[tuple[int, int]] | None = None,
) -> list[dict]:
    """`count` conversational preference rows with images, as TRL's `DataCollatorForVisionPreference` takes them.

    Each row has `images` (noise from `make_image`, sizes drawn from `sizes`, default `IMAGE_SIZES`), a user `prompt`
    with one `{"type": "image"}` part per image before its text, and one-message assistant `chosen` / `rejected`.
    Text lengths vary: 1 to 12 prompt words, 1 to 16 completion words, one-word completions every few rows.
    `images_per_row` is a count, or counts cycled over the rows. The rows do not depend on `model_type` (it is only
    checked), so every family sees the same data for the same seed.
    """
    _check_family(model_type)
    rng = random.Random(seed)
    counts = [images_per_row] if isinstance(images_per_row, int) else list(images_per_row)
    sizes = list(sizes or IMAGE_SIZES)
    rows = []
    for index in range(count):
        images = [
            make_image(*rng.choice(sizes), seed=rng.randrange(2**31)) for _ in range(counts[index % len(counts)])
        ]
        chosen_words = 1 if index % 5 == 0 else rng.randint(1, 16)
        rejected_words = 1 if index % 7 == 3 else rng.randint(1, 16)
        prompt = [{"type": "image"} for _ in images] + [{"type": "text", "text": _sentence(rng, rng.randint(1, 12))}]
        rows.append(
            {
                "images": images,
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": [{"type": "text", "text": _sentence(rng, chosen_words)}]}],
                "rejected": [
                    {"role": "assistant", "content": [{"type": "text", "text": _sentence(rng, rejected_words)}]}
                ],
            }
        )
    return rows


def _check_family(model_type: str) -> None:
    if model_type not in VISION_FAMILIES + EAGER_FAMILIES:
        raise ValueError(
            f"Unknown vision model type {model_type!r}; choose one of {VISION_FAMILIES + EAGER_FAMILIES}."
        )


# --- Trainers -----------------------------------------------------------------------------------------------------


def make_vision_trainer(
    model_type: str,
    padding_free: bool,
    rows: list[dict] | None = None,
    ref_seed: int | None = 1,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    model_overrides: dict | None = None,
    eval_rows: list[dict] | None = None,
    **config_kwargs,
):
    """A `trl_padfree.DPOTrainer` on a tiny `model_type` model and `rows` (default: 8 of `vision_preference_rows`),
    fp32 on CPU unless `config_kwargs` say otherwise; the reference has other weights (`ref_seed`)."""
    from datasets import Dataset

    from trl_padfree import DPOConfig, DPOTrainer

    processor = make_vision_processor(model_type)
    rows = rows if rows is not None else vision_preference_rows(model_type, 8)
    options = dict(
        output_dir="/tmp/trl-padfree-tests",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        seed=0,
        report_to=[],
        save_strategy="no",  # the Qwen-VL and SmolVLM processors here cannot save
        bf16=False,
        use_cpu=True,
    )
    args = DPOConfig(padding_free=padding_free, **{**options, **config_kwargs})

    def model(seed):
        return make_vision_model(model_type, processor, seed, dtype, attn_implementation, **(model_overrides or {}))

    return DPOTrainer(
        model=model(0),
        ref_model=model(ref_seed) if ref_seed is not None else None,
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(eval_rows) if eval_rows is not None else None,
        processing_class=processor,
    )
