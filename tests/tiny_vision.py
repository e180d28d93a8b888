r"""Tiny vision-language models and matching processors, built in memory with no download, fast on CPU.

    processor = make_vision_processor("qwen2_5_vl")  # the shipped tokenizer + the family's special tokens
    model = make_vision_model("qwen2_5_vl", processor)  # Qwen2_5_VLForConditionalGeneration, random weights
    rows = vision_preference_rows("qwen2_5_vl", 8)  # conversational pairs with noise images, for DPOTrainer

Families (`VISION_FAMILIES`): qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe, glm4v, glm4v_moe,
glm46v, gemma3, llava, vipllava, llava_next, llava_onevision, internvl, aya_vision, mistral3, idefics2, idefics3,
smolvlm, glm_ocr (GLM-4V's layout and GLM-4.6V's processor), paddleocr_vl, gemma4, gemma4_unified, shieldgemma2,
minicpmv4_6, minicpm_ocr, minicpmv4_7, cosmos3_omni, hyperclovax_vision_v2, lfm3_vl, video_llava, qianfan_ocr,
deepseek_vl, deepseek_vl_hybrid, granite4_vision, ovis2, janus, kimi_k25 (DeepSeek-V3's
language model), glmga (GLM-4.6V's class and processor), cosmos3_edge, exaone4_5, aria, qwen2_5_omni_thinker and
qwen3_omni_moe_thinker (Qwen2.5-VL's and Qwen3-VL-MoE's towers and language models beside an audio tower, frozen:
image pairs never run it), got_ocr2 and pp_chart2table (GOT-OCR2's model); and `EAGER_FAMILIES`, exact on
eager attention only: hy_v4_vl (a newline token after each merged row of an image). Each
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
    cosmos3_omni    as Qwen3-VL (its processor)                           mm_token_type_ids (<|image_pad|>)
    hyperclovax_vision_v2  pixel_values (P, 1176), image_grid_thw (4, 3)  none (plain 1-D positions)
    lfm3_vl         pixel_values (P, 1536), image_grid_thw (4, 3)         none (plain 1-D positions)
    gemma3          pixel_values (4, 3, 32, 32)                           token_type_ids (soft tokens)
    shieldgemma2    as gemma3 (Gemma3ForConditionalGeneration, Gemma 3's processor)
    llava           pixel_values (4, 3, 32, 32)                           none
    video_llava     pixel_values_images (4, 3, 32, 32)                    none
    idefics3        pixel_values (4, N, 3, 32, 32), pixel_attention_mask  none
    smolvlm           (4, N, 32, 32), as Idefics3                         none
    llava_next      pixel_values (I, 5, 3, 32, 32), image_sizes (I, 2)   none (a base tile and up to 2 x 2 tiles)
    llava_onevision as LLaVA-NeXT, and batch_num_images (4,)              none
    internvl        pixel_values (tiles, 3, 32, 32)                       none (1-4 tiles and a thumbnail per image)
    aya_vision      pixel_values (tiles, 3, 32, 32)                       none (as InternVL)
    qianfan_ocr     pixel_values (tiles, 3, 32, 32)                       none (as InternVL)
    mistral3        pixel_values (I, 3, 64, 64), image_sizes (I, 2)       none (padded to the largest image)
    paddleocr_vl    pixel_values (P, 3, 14, 14), image_grid_thw (4, 3)    mm_token_type_ids (<|IMAGE_PLACEHOLDER|>)
    gemma4          pixel_values (I, 280, 48), image_position_ids         mm_token_type_ids (soft tokens)
                      (I, 280, 2)                                         (every image's 4-pixel patches padded to 280)
    gemma4_unified  pixel_values (I, 70, 192), image_position_ids         mm_token_type_ids (soft tokens)
                      (I, 70, 2)                                          (2 x 2 patches merged into one, a token each)
    minicpm*        pixel_values (1, 3, 14, L), target_sizes (crops, 2)   mm_token_type_ids, 4.7 only (image tokens)
    deepseek_vl     pixel_values (I, 3, 32, 32)                           none
    deepseek_vl_hybrid  as DeepSeek-VL, and high_res_pixel_values (I, 3, 64, 64)
    granite4_vision as LLaVA-NeXT                                         none (4 tokens per tile, and newlines)
    ovis2           pixel_values (tiles, 3, 32, 32)                       none (a whole image, then 1-4 tiles if more)
    janus           pixel_values (I, 3, 32, 32)                           none
    got_ocr2        pixel_values (tiles, 3, 32, 32)                       none (1-4 tiles and a thumbnail per image)
    pp_chart2table  pixel_values (I, 3, 32, 32)                           none (an image a tile)
    kimi_k25        pixel_values (P, 3, 14, 14), image_grid_thw (4, 3)    none (plain positions)
    cosmos3_edge    pixel_values (P, 768), image_grid_thw (4, 3)          mm_token_type_ids (<|image_pad|>)
    exaone4_5       pixel_values (P, 1176), image_grid_thw (4, 3)         none (plain positions)
    qwen2_5_omni_thinker  as qwen2_5_vl                                   none (images found by <|vision_start|>)
    qwen3_omni_moe_thinker  as qwen3_vl                                   none (as Qwen2.5-Omni's)

    family          config's image id   = processor.image_token_id   tokens per image (default options)
    qwen*           image_token_id      yes                          1-12 <|image_pad|> in <|vision_start|> ... end
    gemma3          image_token_index   no: the processor's is boi   \n\n <boi> 4 x <image_soft_token> <eoi> \n\n
    llava           image_token_index   yes                          16 <image>
    video_llava     image_token_index   yes                          16 <image>, as LLaVA
    idefics3        image_token_id      yes                          <fake> <global-img> 4 x <image> <fake>
    smolvlm         image_token_id      yes                          as Idefics3 (12 or 20 <image> if split)
    llava_next(_ov) image_token_index   yes                          16 per tile + a newline per row of tokens
    internvl        image_token_id      yes                          <img> 4 x <IMG_CONTEXT> per tile </img>
    qianfan_ocr     image_token_id      yes                          as InternVL, for the template's <image>
    aya_vision      image_token_index   yes                          TILE_k 4 x <|IMG_PATCH|> per tile, in START/END
    mistral3        image_token_index   yes                          a [IMG] per merged patch, rows ended by [IMG_BREAK]
    paddleocr_vl    image_token_id      yes                          1-12 <|IMAGE_PLACEHOLDER|> in <|IMAGE_START|> ... END
    gemma4          image_token_id      yes (its placeholder is      <boi> 56-70 x <image_soft_token> <eoi> (2 x 2
                                        the soft token)              patches each, as many as 70 tokens fit)
    gemma4_unified  image_token_id      yes (as gemma4)              as gemma4 (a merged patch a token)
    minicpm*        image_token_id      yes                          <image_id>k</image_id><image> n x <image_pad>
                                                                     </image>, then <slice>...</slice> per slice;
                                                                     n = patches / 16 (OCR: / 4) per crop
    deepseek_vl(_h) image_token_id      yes                          16 <image_placeholder>
    granite4_vision image_token_index   yes                          as LLaVA-NeXT, 4 per tile
    ovis2           image_token_id      no: <image>, the model's is  <IMG_START> 4 x <IMG_ATOM> <IMG_GRID> then 4 per
                                        <IMG_ATOM>                   tile between <IMG_COL> / <IMG_ROW>, <IMG_END>
    janus           image_token_id      its tokenizer's (none on it) <begin_of_image> 16 <image_placeholder>
                                                                 <end_of_image>
    got_ocr2        image_token_index   yes                          <img> 4 x <imgpad> per tile </img>
    pp_chart2table  image_token_index   no: the template writes the  <img> 4 x <imgpad> </img>
                                        tokens, the processor none
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
Video-LLaVA freezes its image tower's post-layernorm as LLaVA does, and its video tower, which image pairs never run.
LFM3-VL's language model has 3 layers (a short convolution, a sliding-window and a full attention layer), its
tower 2 (a convolution, then attention), so that each kind of layer runs. Qianfan-OCR's tower drops no path
(`drop_path_rate=0`, the checkpoints' 0.1 would drop different layers in the padded and the packed step).
DeepSeek-VL hybrid's zero-initialised gate on its SAM tower's global features gets a small random value; Janus's image
generator (VQ-VAE, generation embeddings, aligner and head), which understanding never runs, is frozen.

Without torchvision there is no video processor: the Qwen-VL (Cosmos3-Omni's and Qwen-Omni's too),
HyperCLOVAX-Vision-V2, LFM3-VL, Video-LLaVA, GLM-4V, LLaVA-OneVision, InternVL, SmolVLM and Gemma 4 processors here are subclasses that accept `video_processor=None` (SmolVLM's also skips its `num2words` requirement,
which only video prompts need). They handle images and text only, and their `save_pretrained` fails (AttributeError on
the missing video processor); train with `save_strategy="no"`. Pixtral's processor (Mistral 3's) cannot even be imported without torchvision:
`StandInPixtralProcessor` writes its tokens where it is absent; Gemma 4 Unified's image processor needs it too:
`StandInGemma4UnifiedImageProcessor` returns its merged patches. MiniCPM-V's processors are subclasses without a video
processor too, and MiniCPM-OCR's torchvision-only image processor is stood in for by MiniCPM-V 4.6's PIL one in its
4x mode (the same crops; OCR's upscaling of small images aside). Kimi K2.5's image processor has only a torchvision
backend: `StandInKimiK25ImageProcessor` makes its patches with PIL. GOT-OCR2's and PP-Chart2Table's processors refuse
text without images, which TRL's collator sends for the completions: `TextWithoutImagesGotOcr2Processor` and
`TextWithoutImagesPPChart2TableProcessor` tokenize it alone (and take TRL's images, a list per example, flattened).
The Gemma 3, LLaVA, LLaVA-NeXT, Aya Vision, Qianfan-OCR, Idefics, DeepSeek-VL, Granite 4 Vision, Ovis 2, Janus and Aria
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
    AriaImageProcessorPil,
    AriaProcessor,
    AutoConfig,
    AutoModelForImageTextToText,
    AyaVisionProcessor,
    Cosmos3EdgeImageProcessorPil,
    Cosmos3EdgeProcessor,
    DeepseekVLHybridImageProcessorPil,
    DeepseekVLHybridProcessor,
    DeepseekVLImageProcessorPil,
    DeepseekVLProcessor,
    Exaone4_5_Processor,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Gemma4AudioFeatureExtractor,
    Gemma4ImageProcessorPil,
    Gemma4Processor,
    Gemma4UnifiedProcessor,
    Glm4vImageProcessorPil,
    Glm4vProcessor,
    Glm46VImageProcessorPil,
    Glm46VProcessor,
    GlmgaImageProcessorPil,
    GotOcr2ImageProcessorPil,
    GotOcr2Processor,
    Granite4VisionProcessor,
    HyperCLOVAXVisionV2Processor,
    Idefics2ImageProcessorPil,
    Idefics2Processor,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    InternVLProcessor,
    JanusImageProcessorPil,
    JanusProcessor,
    Kimi_K25Processor,
    Lfm3VlProcessor,
    LlavaImageProcessorPil,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    LlavaProcessor,
    MiniCPMOcrProcessor,
    MiniCPMV4_6ImageProcessorPil,
    MiniCPMV4_6Processor,
    MiniCPMV4_7Processor,
    Ovis2ImageProcessorPil,
    Ovis2Processor,
    PaddleOCRVLImageProcessorPil,
    PaddleOCRVLProcessor,
    PixtralImageProcessorPil,
    PPChart2TableImageProcessorPil,
    PPChart2TableProcessor,
    PreTrainedModel,
    ProcessorMixin,
    QianfanOCRProcessor,
    Qwen2_5_VLProcessor,
    Qwen2_5OmniProcessor,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3OmniMoeProcessor,
    Qwen3VLProcessor,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
    VideoLlavaImageProcessor,
    VideoLlavaProcessor,
    WhisperFeatureExtractor,
)
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.processing_utils import ImagesKwargs

from trl_padfree.cli.bench.vision import QWEN_VL_TOKENS, WithoutVideoProcessor
from trl_padfree.data import load_demo_tokenizer

VISION_FAMILIES = (
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe", "glm46v", "gemma3", "llava",
    "vipllava", "llava_next", "llava_onevision", "internvl", "aya_vision", "mistral3", "idefics2",
    "idefics3", "smolvlm", "glm_ocr", "paddleocr_vl", "gemma4", "gemma4_unified", "shieldgemma2", "minicpmv4_6",
    "minicpm_ocr", "minicpmv4_7",
    "cosmos3_omni", "hyperclovax_vision_v2", "lfm3_vl", "video_llava", "qianfan_ocr",
    "deepseek_vl", "deepseek_vl_hybrid", "granite4_vision", "ovis2", "janus",
)  # fmt: skip
VISION_FAMILIES += ("kimi_k25",)
VISION_FAMILIES += ("glmga", "cosmos3_edge")
VISION_FAMILIES += ("exaone4_5",)
VISION_FAMILIES += ("aria",)
# Qwen2.5-Omni's and Qwen3-Omni's thinkers: Qwen2.5-VL's and Qwen3-VL-MoE's images and language models beside an
# audio tower (which image pairs never run), images found by the vision-start token before them
OMNI_FAMILIES = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")
VISION_FAMILIES += OMNI_FAMILIES
GOT_OCR2_FAMILIES = ("got_ocr2", "pp_chart2table")  # PP-Chart2Table: GOT-OCR2's model under its own processor
VISION_FAMILIES += GOT_OCR2_FAMILIES
# Exact on eager attention only (its sparse indexer reads the attention mask): tests/test_vision.py trains it there
# HY-V4-VL exists from transformers 5.24 (the floors have 5.23)
EAGER_FAMILIES = ("hy_v4_vl",) if "hy_v4_vl" in CONFIG_MAPPING_NAMES else ()
LLAVA_FAMILIES = ("llava", "vipllava", "llava_next", "llava_onevision")
ANYRES_FAMILIES = ("llava_next", "llava_onevision")  # any-resolution tiles: a base tile and a grid of them
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
MOE_FAMILIES = (
    "qwen3_vl_moe",
    "qwen3_5_moe",
    "glm4v_moe",
    "qwen3_omni_moe_thinker",
)  # a router loss: prefix sharing refused with it (test_moe_aux_loss)
IDEFICS_FAMILIES = ("idefics2", "idefics3", "smolvlm")
TILE_FAMILIES = ("internvl", "aya_vision")  # images cut into tiles of a fixed number of tokens, and a thumbnail
# MiniCPM-V: an image and its slices NaViT-packed (crops of any size along one axis), a Qwen3.5 language model
MINICPM_FAMILIES = ("minicpmv4_6", "minicpm_ocr", "minicpmv4_7")
# Qwen-VL's image layout and tokens before a language model on plain 1-D positions (no get_rope_index)
PLAIN_POSITION_FAMILIES = ("hyperclovax_vision_v2", "lfm3_vl")
DEEPSEEK_VL_FAMILIES = ("deepseek_vl", "deepseek_vl_hybrid")  # the hybrid adds a SAM tower on high-resolution copies

# Special tokens, given ids after the shipped tokenizer's 2048
QWEN_TOKENS = QWEN_VL_TOKENS
GEMMA_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
GEMMA4_FAMILIES = ("gemma4", "gemma4_unified")
# ShieldGemma 2 is a Gemma 3 (AutoModelForImageTextToText builds Gemma3ForConditionalGeneration from its config); its own
# processor writes policy prompts and refuses text without images, which TRL's collator sends for the completions, so
# it trains with Gemma 3's processor
GEMMA3_FAMILIES = ("gemma3", "shieldgemma2")
# Gemma 4's processor also reads its audio tokens off the tokenizer (it refuses to run without boa / eoa)
GEMMA4_TOKENS = {
    **GEMMA_TOKENS,
    "boa_token": "<start_of_audio>",
    "audio_token": "<audio_soft_token>",
    "eoa_token": "<end_of_audio>",
}
LLAVA_TOKENS = ("<image>", "<video>")  # LLaVA-OneVision's processor also looks its video token up
GRANITE4_VISION_TOKENS = ("<image>",)
# Ovis 2's processor writes an image as <IMG_START>, its whole image's <IMG_ATOM> tokens, <IMG_GRID>, its tiles'
# (between <IMG_COL> and <IMG_ROW>), <IMG_END>: the model embeds those five indicators from its visual vocabulary
OVIS2_INDICATORS = ("<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>")
OVIS2_TOKENS = ("<image>", "<IMG_ATOM>", *OVIS2_INDICATORS)
# Janus's processor reads these names off its tokenizer
JANUS_TOKENS = {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"}
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
# MiniCPM-V's processors read these names off their tokenizer
MINICPM_TOKENS = {
    "image_token": "<image_pad>",
    "video_token": "<video_pad>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
DEEPSEEK_VL_TOKENS = {"image_token": "<image_placeholder>"}  # DeepSeek-VL's processor reads it off its tokenizer
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
ARIA_TOKENS = {"image_token": "<|img|>"}  # Aria's processor reads it off its tokenizer
# The Qwen-Omni processors read these names off their tokenizer (Qwen3-Omni's tokens; Qwen2.5-Omni's checkpoints
# spell them <|vision_bos|>, <|IMAGE|>, ...): Qwen-VL's four first, which _qwen_config reads
OMNI_TOKENS = {
    "vision_bos_token": QWEN_TOKENS[0],
    "vision_eos_token": QWEN_TOKENS[1],
    "image_token": QWEN_TOKENS[2],
    "video_token": QWEN_TOKENS[3],
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "audio_token": "<|audio_pad|>",
}
# GOT-OCR2's image span: <img>, the image's <imgpad> tokens, </img>
GOT_OCR2_TOKENS = {"start": "<img>", "image_token": "<imgpad>", "end": "</img>"}
GOT_OCR2_TOKENS_PER_TILE = 4  # SAM's 8 x 8 patches of a tile, convolved twice with stride 2
# What the chat template writes for an image part; the processor expands it to the image's tokens
IMAGE_PLACEHOLDERS = {
    **dict.fromkeys(QWEN_FAMILIES, "<|vision_start|><|image_pad|><|vision_end|>"),
    **dict.fromkeys(GEMMA3_FAMILIES, GEMMA_TOKENS["boi_token"]),
    **dict.fromkeys(GEMMA4_FAMILIES, GEMMA4_TOKENS["image_token"]),  # expanded to <boi>, the soft tokens, <eoi>
    **dict.fromkeys(GLM_FAMILIES, "<|begin_of_image|><|image|><|end_of_image|>"),
    **dict.fromkeys(LLAVA_FAMILIES, "<image>"),
    **dict.fromkeys(IDEFICS_FAMILIES, "<image>"),
    "internvl": INTERNVL_TOKENS["context_image_token"],
    "aya_vision": "<image>",
    "mistral3": PIXTRAL_TOKENS[0],
    "paddleocr_vl": "".join(PADDLEOCR_TOKENS.values()),
    **dict.fromkeys(MINICPM_FAMILIES, MINICPM_TOKENS["image_token"]),
    **dict.fromkeys(("cosmos3_omni", *PLAIN_POSITION_FAMILIES), "<|vision_start|><|image_pad|><|vision_end|>"),
    "video_llava": "<image>",
    "qianfan_ocr": "<image>",  # its processor's `image_placeholder_token`, expanded to InternVL's tokens
    **dict.fromkeys(DEEPSEEK_VL_FAMILIES, DEEPSEEK_VL_TOKENS["image_token"]),
    "granite4_vision": GRANITE4_VISION_TOKENS[0],
    "ovis2": OVIS2_TOKENS[0],
    "janus": JANUS_TOKENS["image_token"],
    "kimi_k25": "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
    "cosmos3_edge": "<|vision_start|><|image_pad|><|vision_end|>",
    "exaone4_5": "<|vision_start|><|image_pad|><|vision_end|>",
    "hy_v4_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "aria": ARIA_TOKENS["image_token"],
    **dict.fromkeys(OMNI_FAMILIES, "<|vision_start|><|image_pad|><|vision_end|>"),
    "got_ocr2": "".join(GOT_OCR2_TOKENS.values()),
    # PP-Chart2Table's processor expands nothing: its template writes an image's tokens (the checkpoint's, 16 x 16)
    "pp_chart2table": GOT_OCR2_TOKENS["start"]
    + GOT_OCR2_TOKENS["image_token"] * GOT_OCR2_TOKENS_PER_TILE
    + GOT_OCR2_TOKENS["end"],
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
    elif model_type in GEMMA3_FAMILIES:
        tokens = tuple(GEMMA_TOKENS.values())
    elif model_type in GEMMA4_FAMILIES:
        tokens = tuple(GEMMA4_TOKENS.values())
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
    elif model_type in MINICPM_FAMILIES:
        tokens = tuple(MINICPM_TOKENS.values())
    elif model_type in ("cosmos3_omni", *PLAIN_POSITION_FAMILIES):
        tokens = QWEN_TOKENS
    elif model_type == "video_llava":
        tokens = LLAVA_TOKENS
    elif model_type == "qianfan_ocr":
        tokens = tuple(INTERNVL_TOKENS.values())
    elif model_type in DEEPSEEK_VL_FAMILIES:
        tokens = tuple(DEEPSEEK_VL_TOKENS.values())
    elif model_type == "granite4_vision":
        tokens = GRANITE4_VISION_TOKENS
    elif model_type == "ovis2":
        tokens = OVIS2_TOKENS
    elif model_type == "janus":
        tokens = tuple(JANUS_TOKENS.values())
    elif model_type == "kimi_k25":
        tokens = KIMI_TOKENS
    elif model_type == "cosmos3_edge":
        tokens = QWEN_TOKENS
    elif model_type in ("exaone4_5", "hy_v4_vl"):
        tokens = QWEN_TOKENS
    elif model_type == "aria":
        tokens = tuple(ARIA_TOKENS.values())
    elif model_type in OMNI_FAMILIES:
        tokens = tuple(OMNI_TOKENS.values())
    elif model_type in GOT_OCR2_FAMILIES:
        tokens = tuple(GOT_OCR2_TOKENS.values())
    else:
        tokens = IDEFICS_TOKENS
    tokenizer.add_special_tokens({"extra_special_tokens": list(tokens)}, replace_extra_special_tokens=False)
    if model_type in GEMMA3_FAMILIES:
        # Gemma3Processor reads `tokenizer.boi_token`, `.image_token`, `.eoi_token` and their ids; the named
        # model-specific tokens are how a Gemma 3 checkpoint's tokenizer config declares them
        tokenizer._set_model_specific_special_tokens(GEMMA_TOKENS)
    if model_type in GEMMA4_FAMILIES:
        tokenizer._set_model_specific_special_tokens(GEMMA4_TOKENS)
    if model_type in ("internvl", "qianfan_ocr"):
        tokenizer._set_model_specific_special_tokens(INTERNVL_TOKENS)
    if model_type == "paddleocr_vl":
        tokenizer._set_model_specific_special_tokens({"image_token": PADDLEOCR_TOKENS["image_token"]})
    if model_type in MINICPM_FAMILIES:
        tokenizer._set_model_specific_special_tokens(MINICPM_TOKENS)
    if model_type in DEEPSEEK_VL_FAMILIES:
        tokenizer._set_model_specific_special_tokens(DEEPSEEK_VL_TOKENS)
    if model_type == "janus":
        tokenizer._set_model_specific_special_tokens(JANUS_TOKENS)
    if model_type == "aria":
        tokenizer._set_model_specific_special_tokens(ARIA_TOKENS)
    if model_type in OMNI_FAMILIES:
        tokenizer._set_model_specific_special_tokens(OMNI_TOKENS)
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


class _MiniCPMWithoutVideoProcessor(WithoutVideoProcessor):
    """MiniCPM-V's processors without a video processor: their `__init__` reads its slice and downsample modes, which
    only video prompts use; this sets what it sets for images and text."""

    def __init__(self, image_processor=None, video_processor=None, tokenizer=None, chat_template=None, **kwargs):
        ProcessorMixin.__init__(
            self, image_processor, video_processor, tokenizer, chat_template=chat_template, **kwargs
        )
        self.slice_mode = image_processor.slice_mode
        self.default_use_image_id = image_processor.use_image_id
        self.image_token_divisor = 4 if image_processor.downsample_mode == "4x" else 16
        for name in MINICPM_TOKENS:
            setattr(self, name, getattr(tokenizer, name))
        self.image_token_id, self.video_token_id = tokenizer.image_token_id, tokenizer.video_token_id


class TinyMiniCPMV4_6Processor(_MiniCPMWithoutVideoProcessor, MiniCPMV4_6Processor):
    """`MiniCPMV4_6Processor` without a video processor."""


class TinyMiniCPMOcrProcessor(_MiniCPMWithoutVideoProcessor, MiniCPMOcrProcessor):
    """`MiniCPMOcrProcessor` without a video processor."""


class TinyMiniCPMV4_7Processor(_MiniCPMWithoutVideoProcessor, MiniCPMV4_7Processor):
    """`MiniCPMV4_7Processor` without a video processor."""


_MINICPM_PROCESSORS = {
    "minicpmv4_6": TinyMiniCPMV4_6Processor,
    "minicpm_ocr": TinyMiniCPMOcrProcessor,
    "minicpmv4_7": TinyMiniCPMV4_7Processor,
}


class TinyHyperCLOVAXVisionV2Processor(WithoutVideoProcessor, HyperCLOVAXVisionV2Processor):
    """`HyperCLOVAXVisionV2Processor` without a video processor."""


class TinyLfm3VlProcessor(WithoutVideoProcessor, Lfm3VlProcessor):
    """`Lfm3VlProcessor` without a video processor."""


class TinyVideoLlavaProcessor(WithoutVideoProcessor, VideoLlavaProcessor):
    """`VideoLlavaProcessor` without a video processor."""


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


class TinyQwen2_5OmniProcessor(WithoutVideoProcessor, Qwen2_5OmniProcessor):
    """`Qwen2_5OmniProcessor` without a video processor."""


class TinyQwen3OmniMoeProcessor(WithoutVideoProcessor, Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` without a video processor."""


def _omni_processor(model_type, tokenizer, template):
    """Qwen2.5-VL's image processor (Qwen3-VL's 16-pixel patches for Qwen3-Omni), images resized to 1 to 12 merged
    patches, and Whisper's feature extractor (the checkpoints' own), which image pairs never call."""
    patch_size = 16 if model_type == "qwen3_omni_moe_thinker" else 14
    token_pixels = (2 * patch_size) ** 2
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=2, temporal_patch_size=2, min_pixels=token_pixels,
        max_pixels=12 * token_pixels,
    )  # fmt: skip
    processor_class = TinyQwen3OmniMoeProcessor if model_type == "qwen3_omni_moe_thinker" else TinyQwen2_5OmniProcessor
    return processor_class(image_processor, None, WhisperFeatureExtractor(), tokenizer, chat_template=template)


def _cosmos3_processor(model_type, tokenizer, template, **options):
    """Cosmos3-Omni's checkpoints ship Qwen3-VL's processor."""
    return _qwen_processor("qwen3_vl", tokenizer, template, **options)


def _plain_position_processor(model_type, tokenizer, template):
    """HyperCLOVAX-Vision-V2 (Qwen2.5-VL's 14-pixel patches) and LFM3-VL (16-pixel ones): Qwen-VL's image processor,
    images resized to 1 to 12 merged patches (image tokens), `<|image_pad|>` repeated per merged patch."""
    patch_size = 16 if model_type == "lfm3_vl" else 14
    token_pixels = (2 * patch_size) ** 2
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=token_pixels,
        max_pixels=12 * token_pixels,
    )
    processor_class = TinyLfm3VlProcessor if model_type == "lfm3_vl" else TinyHyperCLOVAXVisionV2Processor
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


def _hy_v4_vl_processor(model_type, tokenizer, template):
    """Images resized to 1 to 12 merged patches of 16-pixel patches, one frame each; a newline token after each row
    of merged patches: up to 18 image tokens. (HY-V4-VL is new in transformers 5.24: imported here, not at the top,
    so that the floors' 5.23 imports this file.)"""
    from transformers import HYV4VLImageProcessorPil, HYV4VLProcessor

    class TinyHYV4VLProcessor(WithoutVideoProcessor, HYV4VLProcessor):
        """`HYV4VLProcessor` without a video processor."""

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


def _video_llava_processor(model_type, tokenizer, template, image_size=32, patch_size=8):
    """As `_llava_processor`, with Video-LLaVA's image processor (its images come back as `pixel_values_images`)."""
    image_processor = VideoLlavaImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return TinyVideoLlavaProcessor(
        image_processor, None, tokenizer, patch_size=patch_size, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=template,
    )  # fmt: skip


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


def _qianfan_ocr_processor(model_type, tokenizer, template, image_size=32, max_tiles=4):
    """As InternVL's (`_tiles_processor`): 1 to `max_tiles` tiles of `image_size` pixels and a thumbnail, 4 tokens
    per tile, written for the template's `<image>`."""
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": image_size, "width": image_size}, crop_to_patches=True, min_patches=1, max_patches=max_tiles
    )
    return QianfanOCRProcessor(image_processor, tokenizer, image_seq_length=4, chat_template=template)


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


def _minicpm_processor(model_type, tokenizer, template, scale_resolution=56, max_slice_nums=4):
    """Crops of `scale_resolution` pixels or so, in whole 14-pixel patches merged 4 x 4 (MiniCPM-OCR: 2 x 2) into
    tokens; an image larger than one crop also cut into up to `max_slice_nums` slices. MiniCPM-OCR's own image
    processor needs torchvision: MiniCPM-V 4.6's PIL one in its 4x mode stands in (the same crops, without OCR's
    upscaling of small images)."""
    image_processor = MiniCPMV4_6ImageProcessorPil(
        patch_size=14,
        scale_resolution=scale_resolution,
        max_slice_nums=max_slice_nums,
        downsample_mode="4x" if model_type == "minicpm_ocr" else "16x",
    )
    return _MINICPM_PROCESSORS[model_type](image_processor, None, tokenizer, chat_template=template)


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


def _ovis2_processor(model_type, tokenizer, template, image_size=32, max_tiles=4, image_seq_length=4):
    """Images cut into 1 to `max_tiles` tiles of `image_size` pixels by their aspect ratio, after the whole image;
    `image_seq_length` tokens per tile."""
    image_processor = Ovis2ImageProcessorPil(
        size={"height": image_size, "width": image_size}, crop_to_patches=True, max_patches=max_tiles
    )
    return Ovis2Processor(image_processor, tokenizer, chat_template=template, image_seq_length=image_seq_length)


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


_PROCESSOR_BUILDERS = {
    **dict.fromkeys(QWEN_FAMILIES, _qwen_processor),
    **dict.fromkeys(GLM_FAMILIES, _glm4v_processor),
    **dict.fromkeys(GEMMA3_FAMILIES, _gemma3_processor),
    **dict.fromkeys(GEMMA4_FAMILIES, _gemma4_processor),
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
    **dict.fromkeys(MINICPM_FAMILIES, _minicpm_processor),
    "cosmos3_omni": _cosmos3_processor,
    **dict.fromkeys(PLAIN_POSITION_FAMILIES, _plain_position_processor),
    "video_llava": _video_llava_processor,
    "qianfan_ocr": _qianfan_ocr_processor,
    **dict.fromkeys(DEEPSEEK_VL_FAMILIES, _deepseek_vl_processor),
    "granite4_vision": _granite4_vision_processor,
    "ovis2": _ovis2_processor,
    "janus": _janus_processor,
    "aria": _aria_processor,
    **dict.fromkeys(OMNI_FAMILIES, _omni_processor),
    **dict.fromkeys(GOT_OCR2_FAMILIES, _got_ocr2_processor),
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


def _omni_config(model_type, processor):
    """Qwen2.5-Omni's thinker (Qwen2.5-VL's tower and language model) and Qwen3-Omni's (Qwen3-VL-MoE's), and an audio
    tower as narrow as the rest, which image pairs never run (`make_vision_model` freezes it)."""
    values = _qwen_config("qwen3_vl_moe" if model_type == "qwen3_omni_moe_thinker" else "qwen2_5_vl", processor)
    audio_start, audio_end, audio = processor.tokenizer.convert_tokens_to_ids(list(OMNI_TOKENS.values())[4:])
    audio_config = dict(d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, encoder_layers=1, output_dim=32)
    if model_type == "qwen3_omni_moe_thinker":
        audio_config["downsample_hidden_size"] = 8
    return dict(
        values, audio_config=audio_config, audio_token_id=audio, audio_start_token_id=audio_start,
        audio_end_token_id=audio_end,
    )  # fmt: skip


def _cosmos3_config(model_type, processor):
    """Cosmos3-Omni: Qwen3-VL's model and config under its own model type."""
    return _qwen_config("qwen3_vl", processor)


def _plain_position_config(model_type, processor):
    """HyperCLOVAX-Vision-V2 (Qwen2.5-VL's tower, a linear projector, HyperCLOVAX) and LFM3-VL (a Qwen3-VL-like
    tower of short convolutions and attention, an MLP projector, LFM3's convolutions, sliding and full attention):
    the language model on plain positions."""
    image_processor = processor.image_processor
    _, vision = _patch_model(image_processor)
    text = dict(_TEXT, model_type="hyperclovax")
    vision.update(
        hidden_size=_VISION["hidden_size"],
        intermediate_size=_VISION["intermediate_size"],
        out_hidden_size=_VISION["hidden_size"],
        window_size=2 * image_processor.merge_size * image_processor.patch_size,
        fullatt_block_indexes=[1],
    )
    values = {}
    if model_type == "lfm3_vl":
        text = dict(
            _TEXT, model_type="lfm3", num_hidden_layers=3, head_dim=_HEAD_DIM, sliding_window=_SLIDING_WINDOW,
            layer_types=["conv", "sliding_attention", "full_attention"],
        )  # fmt: skip
        vision = dict(
            _VISION, num_key_value_heads=1, patch_size=image_processor.patch_size,
            spatial_merge_size=image_processor.merge_size, temporal_patch_size=image_processor.temporal_patch_size,
            layer_types=["conv", "full_attention"],
        )  # fmt: skip
        start_id, end_id = processor.tokenizer.convert_tokens_to_ids(QWEN_TOKENS[:2])
        values = dict(projector_hidden_size=_TEXT["intermediate_size"], vision_start_token_id=start_id,
                      vision_end_token_id=end_id)  # fmt: skip
    return dict(
        text_config=text,
        vision_config=vision,
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        **values,
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


def _gemma4_config(model_type, processor):
    """Gemma 4: a sliding and a full-attention layer (wider heads, as the real ones), per-layer inputs; a vision tower
    over the processor's patches with (x, y) position embeddings, pooled k x k to tokens; no audio tower."""
    image_processor, tokenizer = processor.image_processor, processor.tokenizer
    text = dict(
        _TEXT,
        head_dim=_HEAD_DIM,
        global_head_dim=2 * _HEAD_DIM,
        sliding_window=_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tokenizer),
    )
    patches_per_side = image_processor.max_soft_tokens * image_processor.pooling_kernel_size**2  # a 1-patch-high image
    vision = dict(
        _VISION,
        num_key_value_heads=_VISION["num_attention_heads"],
        head_dim=_VISION["hidden_size"] // _VISION["num_attention_heads"],
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
            mm_embed_dim=_VISION["hidden_size"],
            mm_posemb_size=image_processor.max_soft_tokens,
            output_proj_dims=_VISION["hidden_size"],
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


def _qianfan_ocr_config(model_type, processor):
    """Qianfan-OCR: InternVL's (`_tiles_config`) with Qwen3 and its tower's stochastic depth off (the checkpoints'
    0.1 would drop different layers in the padded and the packed step)."""
    values = _tiles_config("internvl", processor)
    values["text_config"].update(model_type="qwen3", head_dim=_HEAD_DIM)
    values["vision_config"]["drop_path_rate"] = 0.0
    return values


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


def _minicpm_config(model_type, processor):
    """MiniCPM-V 4.6 / 4.7, MiniCPM-OCR: a SigLIP-like tower over each crop, its window merger after layer 0 (16x),
    then the merger, into a Qwen3.5 language model (a gated delta-net layer, then a gated attention layer)."""
    image_processor, tokenizer = processor.image_processor, processor.tokenizer
    text = dict(
        _TEXT, head_dim=_HEAD_DIM, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=_MROPE_SECTION),
    )  # fmt: skip
    vision = dict(_VISION, image_size=image_processor.scale_resolution, patch_size=image_processor.patch_size)
    values = dict(
        text_config=text,
        vision_config=vision,
        insert_layer_id=0,
        downsample_mode=image_processor.downsample_mode,
        image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id,
    )
    if model_type == "minicpmv4_7":  # canvas mRoPE pins the markers around each crop
        newline = tokenizer("\n", add_special_tokens=False).input_ids
        values |= dict(
            image_start_id=tokenizer.image_start_token_id, image_end_id=tokenizer.image_end_token_id,
            slice_start_id=tokenizer.slice_start_token_id, slice_end_id=tokenizer.slice_end_token_id,
            newline_id=newline[0],
        )  # fmt: skip
    return values


def _deepseek_vl_config(model_type, processor):
    """DeepSeek-VL: a SigLIP tower (no pooling head: DeepSeek-VL reads its patches), a token per patch, Llama; the
    hybrid adds a SAM tower on the high-resolution copy, its features resized to SigLIP's grid of patches."""
    image_processor = processor.image_processor
    image_size = image_processor.size["height"]
    patch_size = image_size // math.isqrt(processor.num_image_tokens)
    vision = dict(
        _VISION, model_type="siglip_vision_model", image_size=image_size, patch_size=patch_size, vision_use_head=False
    )
    values = dict(text_config=dict(_TEXT), vision_config=vision, image_token_id=processor.image_token_id)
    if model_type == "deepseek_vl_hybrid":
        high_res_size = image_processor.high_res_size["height"]
        values["high_res_vision_config"] = dict(
            _VISION, model_type="sam_vision_model", image_size=high_res_size, patch_size=high_res_size // 4,
            output_channels=8, mlp_dim=_VISION["intermediate_size"], window_size=2, global_attn_indexes=[1],
            num_pos_feats=16,
        )  # fmt: skip
    return values


_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # the Q-Former's, 0.1 by default


def _granite4_vision_config(model_type, processor):
    """Granite 4 Vision: a CLIP tower (CLS dropped) over LLaVA-NeXT's tiles, its patches queried by Q-Formers in
    windows, the features added to the image tokens before several language model layers (deepstack): one layer's
    from the tower's first layer, then four spatial offsets of its last, each before a layer of its own. The tower is
    64 wide, as its Q-Former takes a head per 64 (Granite4VisionConfig)."""
    image_processor = processor.image_processor
    vision = dict(
        _VISION, hidden_size=64, image_size=image_processor.crop_size["height"], patch_size=processor.patch_size
    )
    return dict(
        text_config=dict(_TEXT, num_hidden_layers=5),
        vision_config=vision,
        qformer_config=dict(num_hidden_layers=1, intermediate_size=_VISION["intermediate_size"], **_NO_DROPOUT),
        image_token_index=processor.image_token_id,
        image_grid_pinpoints=image_processor.image_grid_pinpoints,
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        downsample_rate=processor.downsample_rate,
        deepstack_layer_map=[[1, 0]],
        spatial_target_layers=[1, 2, 3, 4],
        projector_dropout=0.0,
    )


def _ovis2_config(model_type, processor):
    """Ovis 2: each tile's 4 x 4 patches, 2 x 2 per token (`hidden_stride`), scored over a visual vocabulary whose
    embeddings (a softmax-weighted sum) are the token's features; Qwen2."""
    image_size = processor.image_processor.size["height"]
    hidden_stride = 2
    patch_size = image_size // (hidden_stride * math.isqrt(processor.image_seq_length))
    vision = dict(_VISION, image_size=image_size, patch_size=patch_size, hidden_stride=hidden_stride, vocab_size=16)
    tokenizer = processor.tokenizer
    return dict(
        text_config=dict(_TEXT, model_type="qwen2"),
        vision_config=vision,
        hidden_size=_TEXT["hidden_size"],
        vocab_size=len(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_ATOM>"),
        visual_indicator_token_ids=tokenizer.convert_tokens_to_ids(list(OVIS2_INDICATORS)),
    )


def _janus_config(model_type, processor):
    """Janus: its own SigLIP-like tower, a token per patch, Llama; and an image generator (a VQ-VAE with its own
    embeddings, aligner and head) that understanding never runs, here as small as it builds (GroupNorm of 32)."""
    image_size = processor.image_processor.size["height"]
    patch_size = image_size // math.isqrt(processor.num_image_tokens)
    hidden = _TEXT["hidden_size"]
    vision = dict(
        _VISION, image_size=image_size, patch_size=patch_size, num_image_tokens=processor.num_image_tokens,
        projection_dim=hidden, mlp_ratio=2.0,
    )  # fmt: skip
    vq = dict(
        embed_dim=8, num_embeddings=16, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
        num_res_blocks=1, projection_dim=hidden, image_token_embed_dim=hidden,
    )  # fmt: skip
    return dict(
        text_config=dict(_TEXT),
        vision_config=vision,
        vq_config=vq,
        image_token_id=processor.tokenizer.image_token_id,
    )


def _aria_config(model_type, processor):
    """Aria: Idefics3's tower over 980-pixel images in `processor.patch_size` patches, read by a fixed number of
    queries per image (its projector's cross-attention, by patch count), before a MoE language model."""
    image_size = processor.image_processor.max_image_size
    patches = (image_size // processor.patch_size) ** 2
    text = dict(_TEXT, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1)
    return dict(
        text_config=text,
        vision_config=dict(_VISION, image_size=image_size, patch_size=processor.patch_size),
        projector_patch_to_query_dict={patches: processor.size_conversion[image_size]},
        image_token_index=processor.image_token_id,
    )


def _got_ocr2_config(model_type, processor):
    """GOT-OCR2 (and PP-Chart2Table, its model): SAM over each tile's 8 x 8 patches (windows of 2 x 2, then a global
    layer), its features convolved twice with stride 2 to the processor's 2 x 2 tokens per tile; Qwen2. The tower's
    weights drawn as the others' (its config's 1e-10 would leave it, and its gradients, all but zero)."""
    image_size = processor.image_processor.size["height"]
    patch_size = image_size // (4 * math.isqrt(processor.num_image_tokens))
    vision = dict(
        _VISION, image_size=image_size, patch_size=patch_size, window_size=2, global_attn_indexes=[1],
        output_channels=8, mlp_dim=_VISION["intermediate_size"], initializer_range=_INIT_STD,
    )  # fmt: skip
    return dict(
        text_config=dict(_TEXT, model_type="qwen2"),
        vision_config=vision,
        image_token_index=processor.tokenizer.convert_tokens_to_ids(GOT_OCR2_TOKENS["image_token"]),
        image_seq_length=processor.num_image_tokens,
    )


_CONFIG_BUILDERS = {
    **dict.fromkeys(QWEN_FAMILIES, _qwen_config),
    **dict.fromkeys(GLM_FAMILIES, _glm4v_config),
    **dict.fromkeys(GEMMA3_FAMILIES, _gemma3_config),
    **dict.fromkeys(GEMMA4_FAMILIES, _gemma4_config),
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
    **dict.fromkeys(MINICPM_FAMILIES, _minicpm_config),
    "cosmos3_omni": _cosmos3_config,
    **dict.fromkeys(PLAIN_POSITION_FAMILIES, _plain_position_config),
    "video_llava": _video_llava_config,
    "qianfan_ocr": _qianfan_ocr_config,
    **dict.fromkeys(DEEPSEEK_VL_FAMILIES, _deepseek_vl_config),
    "granite4_vision": _granite4_vision_config,
    "ovis2": _ovis2_config,
    "janus": _janus_config,
    "aria": _aria_config,
    **dict.fromkeys(OMNI_FAMILIES, _omni_config),
    **dict.fromkeys(GOT_OCR2_FAMILIES, _got_ocr2_config),
}


def make_vision_config(model_type: str, processor: ProcessorMixin, **config_overrides):
    """The tiny config of `model_type`, consistent with `processor` (token ids, vocabulary, image geometry).

    `config_overrides` set top-level fields; `text_config=` and `vision_config=` dicts are merged into the sub-configs.
    """
    _check_family(model_type)
    values = _CONFIG_BUILDERS[model_type](model_type, processor)
    values["text_config"]["vocab_size"] = len(processor.tokenizer)
    for key in ("text_config", "vision_config", "audio_config"):
        if values.get(key) is not None:  # Gemma 4 sets no audio tower (audio_config None)
            values[key].update(config_overrides.pop(key, {}))
    return AutoConfig.for_model(model_type, **values, **config_overrides)


def make_vision_model(
    model_type: str,
    processor: ProcessorMixin,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **config_overrides,
) -> PreTrainedModel:
    """A randomly initialised tiny `<Family>ForConditionalGeneration` matching `processor`, the same weights for the
    same seed, on `attn_implementation` (default `default_attention(model_type)`); see `make_vision_config` for
    `config_overrides`."""
    attn_implementation = attn_implementation or default_attention(model_type)
    config = make_vision_config(model_type, processor, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    if model_type in GEMMA3_FAMILIES:
        # Gemma 3 initialises its image projection to zero, which would cut every gradient to the vision tower
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=_INIT_STD)
    if model_type == "deepseek_vl_hybrid":
        # Its SAM tower's global features enter through a gate initialised to zero, which would cut their gradients
        torch.nn.init.normal_(model.model.high_res_vision_alpha, std=_INIT_STD)
    if model_type == "janus":  # its image generator, which understanding never runs
        for module in (model.model.vqmodel, model.model.generation_embeddings, model.model.generation_aligner,
                       model.model.generation_head):  # fmt: skip
            module.requires_grad_(False)
    if model_type in ("llava", "aya_vision", "granite4_vision", *ANYRES_FAMILIES):
        # LLaVA takes the tower's hidden states, before its post-layernorm: freeze it, as it gets no gradient
        tower = model.model.vision_tower
        getattr(tower, "vision_model", tower).post_layernorm.requires_grad_(False)
    if model_type in OMNI_FAMILIES:  # its audio tower, which image pairs never run
        model.model.audio_tower.requires_grad_(False)
    if model_type == "video_llava":
        # As LLaVA's, its image tower's post-layernorm gets no gradient; and image pairs never run its video tower
        model.model.image_tower.post_layernorm.requires_grad_(False)
        model.model.video_tower.requires_grad_(False)
    model.config.name_or_path = f"tiny-{model_type}"
    return model


def default_attention(model_type: str) -> str:
    """sdpa, but for the families whose models have none (HY-V4-VL; GOT-OCR2's, whose SAM tower runs its own
    attention): eager, as transformers picks for them."""
    return "eager" if model_type in (*EAGER_FAMILIES, *GOT_OCR2_FAMILIES) else "sdpa"


def save_vision_models(directory, families) -> None:
    """Each family's model in `<directory>/<family>`, with its processor where it saves and `AutoProcessor` loads it back
    as itself (not so without a video processor, or for a stand-in, whose folder AutoProcessor reads as a tokenizer):
    tests/distributed/train_dpo.py builds the others again."""
    from pathlib import Path

    from transformers import AutoProcessor

    directory = Path(directory)
    for model_type in families:
        processor = make_vision_processor(model_type)
        model = make_vision_model(model_type, processor)
        # transformers 5.24 saves Gemma3ForConditionalGeneration under ShieldGemma 2's config with a key layout its own
        # loading does not read back (ShieldGemma 2's conversion mapping is its classifier's, whose `model` holds the
        # Gemma 3): every language-model weight missing, initialised anew at each load. Its own layout loads back
        model.save_pretrained(directory / model_type, save_original_format=model_type != "shieldgemma2")
        _check_loads_back(model_type, directory / model_type)
        if model_type == "qwen3_vl_moe":
            save_experts_in_hub_layout(directory / model_type)
        scratch = directory / "processors" / model_type
        try:
            processor.save_pretrained(scratch)
        except AttributeError:  # no video processor here
            continue
        if type(AutoProcessor.from_pretrained(scratch)) is type(processor):
            processor.save_pretrained(directory / model_type)


def _check_loads_back(model_type: str, model_dir) -> None:
    """Refuse a saved model that does not load back whole: a weight missing from the checkpoint would be initialised
    anew at each load, and a run compared with another would train a different model."""
    loaded, info = AutoModelForImageTextToText.from_pretrained(model_dir, output_loading_info=True)
    wrong = {kind: keys for kind, keys in info.items() if kind in ("missing_keys", "unexpected_keys") and keys}
    del loaded
    assert not wrong, f"{model_type} saved in {model_dir} does not load back: {wrong}"


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
    attn_implementation: str | None = None,
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
