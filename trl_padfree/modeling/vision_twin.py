"""What the architecture check needs to give a vision-language twin images (modeling/packability.py).

A twin of a vision-language model is shrunk as a text model's is, vision tower included; its images are random
pixels of the shapes the model's processor makes, built here per family, and placed in a padded batch laid out as
TRL's vision collator lays one out, which the check then packs as training packs it (packing/vision.py). Per family:

    family                      image inputs (layout)                          geometry kept
    Qwen2-VL, Qwen2.5-VL,       pixel_values of every image's patches,         patch, merge and temporal sizes; mRoPE
    Qwen3-VL (MoE)              image_grid_thw (patches)                       sections over the twin's head
    GLM-4V (MoE), GLM-4.6V,     as Qwen2-VL (patches)                          as Qwen2-VL
    GLM-OCR, GLMGA
    EXAONE 4.5                  as Qwen2-VL (patches)                          patch and merge sizes; plain positions
    Cosmos3 Edge                as Qwen2-VL, one frame a patch (patches)       as Qwen2-VL; its processor returns
                                                                               mm_token_type_ids only if asked
    HY-V4-VL                    as Qwen2-VL (patches); a newline token ends    mRoPE sections over the latent
                                each merged row: (w + 1) x h tokens            attention's rope part
    PaddleOCR-VL, Kimi K2.5     pixel_values of every image's patches, each    patch and merge sizes; (Kimi: plain
                                (3, patch, patch), image_grid_thw (patches)    positions, no mRoPE)
    Cosmos3-Omni                as Qwen3-VL (its classes)                      as Qwen3-VL
    Qwen2.5-Omni, Qwen3-Omni    as Qwen2.5-VL / Qwen3-VL (patches), each       as Qwen-VL; the audio tower (image pairs
    thinkers                    image between vision start and end tokens      never run it) narrowed so it builds; a
                                                                               default config's unset start and end
                                                                               tokens given ids
    HyperCLOVAX-Vision-V2,      as Qwen2.5-VL / Qwen3-VL (patches)             patch, merge and temporal sizes; no
    LFM3-VL                                                                    mRoPE (plain 1-D text positions)
    Gemma 3, ShieldGemma 2      pixel_values (images)                          4 x 4 patches pooled to 4 tokens
    LLaVA, VipLLaVA,            pixel_values (images; Video-LLaVA's            2 x 2 patches, a token each
    Video-LLaVA                 processor names them pixel_values_images)
    Idefics3, SmolVLM           pixel_values, pixel_attention_mask (rows)      2 x 2 tokens of scale^2 patches each
    Idefics2                    pixel_values, pixel_attention_mask (rows)      2 x 2 patches, 4 resampled latents
    LLaVA-NeXT(-Video),         pixel_values of a base tile and 1 x 1, 1 x 2   tiles of 2 x 2 patches; tokens from
    LLaVA-OneVision             or 2 x 1 tiles, image_sizes (sized)            the twin's get_image_features
    Mistral 3, Mistral Large 3, pixel_values padded to the largest image,      up to 8 x 8 patches merged 2 x 2; tokens
    LightOnOCR (Pixtral)        image_sizes (sized)                            from get_image_features
    LFM2-VL (SigLIP2 NaFlex)    flattened patches, their mask, spatial_shapes  4 x 4, 2 x 4, 4 x 2 patches
    InternVL, Aya Vision,       pixel_values of 1, 3 or 2 tiles per image      tiles of 4 x 4 patches, pixel-shuffled
    Command A Vision, Llama 4   (tiles)                                        to 4 tokens
    DeepSeek-VL, Janus          pixel_values (images)                          2 x 2 patches, a token each; Janus's
                                                                               VQ-VAE (image generation) narrowed
    DeepSeek-VL hybrid          pixel_values, high_res_pixel_values (images)   as DeepSeek-VL; SAM on 4 x 4 patches
    Granite 4 Vision            as LLaVA-NeXT (sized)                          tiles of 4 x 4 patches queried by 2 x 2;
                                                                               deepstack [[-1, 0]] where none is set
    Aria                        pixel_values (images; pixel_mask unset)        2 x 2 patches queried by 4; its image
                                                                               token (9) moved to the vocabulary's end
    GOT-OCR2, PP-Chart2Table    pixel_values of 1, 3 or 2 tiles per image      SAM on 8 x 8 patches, convolved to 4
                                (tiles)                                        tokens
    Ovis 2                      pixel_values of 1, 3 or 2 tiles per image      tiles of 2 x 2 tokens of hidden_stride^2
                                (tiles)                                        patches each
    Gemma 4                     each image's patches padded to the most,       2 x 2, 1 x 2, 2 x 1 tokens of k x k
                                image_position_ids (x, y; -1 on padding)       2-pixel patches (k: pooling_kernel_size)
                                (sized)
    Gemma 4 Unified             as Gemma 4, each k x k patches merged into     1 x 3, 1 x 2, 2 x 1 tokens: no longer
                                one by its processor (no vision tower)         than the twin's sliding window (3)
    MiniCPM-V 4.6 / 4.7,        pixel_values (1, C, patch, L): every crop's    crops of 4 x 8, 4 x 4, 8 x 4 patches;
    MiniCPM-OCR                 patches along L, target_sizes (navit)          tokens from get_image_features; a
                                                                               default config's unset image token
                                                                               given one (a checkpoint names it)

Refused whatever the twin measures: Mllama's cross-attention to the images (modeling/vision.py), and the families of
modeling/vision_unsupported.py's `REFUSED` (Molmo 2, whose image tokens attend to every image token of their sequence
and whose pooling indices span the batch, ...).

The families are modeling/vision.py's; another vision-language model is refused on image data, since the check
cannot give its twin images.
"""

from __future__ import annotations

import torch
import transformers

from ..integrations.transformers import base_model_class_names
from .vision import FAMILIES, ImageFamily

# The twin's special tokens (image placeholders, begin and end of image...) move below its vocabulary's end
SPECIAL_TOKEN_SUFFIXES = ("_token_id", "_token_index")
PLAIN_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


# The twin's heads are 8 wide: 4 rotary frequencies, over time, height and width
TWIN_MROPE_SECTION = (1, 1, 2)
# Twin image grids (temporal, height, width, in merged patches) for the patch layout: tokens 4, 2 and 2
TWIN_GRIDS = ((1, 2, 2), (1, 1, 2), (1, 2, 1))
# Patch-layout families whose processors hand each patch over as (channels, patch, patch), not flattened
UNFLATTENED_PATCHES = ("paddleocr_vl", "kimi_k25")
# Patch-layout families whose every merged row of an image ends with a newline token (HY-V4-VL): (w + 1) x h tokens
NEWLINE_PER_ROW = ("hy_v4_vl",)
# Twin images of the sized layouts, in (rows, columns) of the vision tower's square input: any-resolution tiles
# (LLaVA-NeXT), or 2 x 2 merged patches each (Mistral 3)
TWIN_TILE_GRIDS = ((1, 1), (1, 2), (2, 1))
# Token grids (rows, columns) of images of any size: 4, 2 and 2 tokens; 3, 2 and 2 where an image's tokens must fit
# the twin's sliding window (3: `ImageFamily.images_past_window`)
TWIN_GRIDS_2D = ((2, 2), (1, 2), (2, 1))
TWIN_WINDOW_GRIDS_2D = ((1, 3), (1, 2), (2, 1))
# Patch grids (rows, columns) of SigLIP2's images of any size (LFM2-VL): 4, 2 and 2 tokens of 2 x 2 patches
TWIN_PATCH_GRIDS = ((4, 4), (2, 4), (4, 2))
# MiniCPM-V's crops (rows, columns of patches), one per image: 2, 1 and 2 tokens merged 4 x 4 (4x mode: 8, 4, 8)
TWIN_CROP_GRIDS = ((4, 8), (4, 4), (8, 4))
# The any-resolution families: LLaVA-NeXT's base tile and grid of tiles
ANYRES = ("llava_next", "llava_next_video", "llava_onevision")
# Tiles per image of the tiles layout (InternVL, Aya Vision)
TWIN_TILES = (1, 3, 2)
# Gemma 4: images of any size, their patches padded to a fixed count with (x, y) positions, pooled k x k to tokens
GEMMA4 = ("gemma4", "gemma4_unified")
# Gemma 4 Unified has no vision tower: its processor merges each k x k patches into one, a token each
MERGED_PATCHES = ("gemma4_unified",)
# Families of the images layout whose every patch is an image token (DeepSeek-VL)
TOKEN_PER_PATCH = ("deepseek_vl", "deepseek_vl_hybrid", "janus")
# Families with an audio tower, which image pairs never run (Qwen-Omni's thinkers): narrowed only so that it builds,
# its heads dividing the shrunk width (the real 20 do not divide 32)
OMNI_THINKERS = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")
TWIN_AUDIO = dict(encoder_attention_heads=4, encoder_ffn_dim=64, encoder_layers=1, downsample_hidden_size=8)


def remap_special_tokens(values: dict, vocab_size: int) -> None:
    """Move a config's special token ids that the twin's vocabulary cannot hold to its last ids, in place."""
    names = sorted(
        name
        for name, value in values.items()
        if name.endswith(SPECIAL_TOKEN_SUFFIXES)
        and name not in PLAIN_TOKEN_FIELDS
        and isinstance(value, int)
        and not isinstance(value, bool)
        and value >= vocab_size
    )
    for offset, name in enumerate(names, start=1):
        values[name] = vocab_size - offset


def twin_geometry(model_type: str, values: dict, real_head_dims: bool = False) -> None:
    """Fix the shrunk config of a vision-language twin (`values`, as `to_dict` gives it) so its images are small and
    its image features as wide as its language model, in place; with `real_head_dims`, its mRoPE sections stay those
    of the real heads."""
    vision, text = values.get("vision_config"), values.get("text_config")
    if vision is None or text is None:
        return
    hidden = text["hidden_size"]
    if model_type == "qwen2_vl":
        vision["embed_dim"], vision["hidden_size"] = 32, hidden
    if "out_hidden_size" in vision:
        vision["out_hidden_size"] = hidden
    # mRoPE: the rotary half of a head, for a model with its own position function or MiniCPM-V's Qwen3.5 language
    # model (navit); not for a language model on plain 1-D positions, whose rotary config may not take the key
    # (LFM3-VL's is per layer type)
    layout = FAMILIES[model_type].layout
    if (
        layout in ("patches", "navit")
        and not real_head_dims
        and (layout == "navit" or has_position_function(model_type))
    ):
        rope = text.get("rope_parameters") or {}
        text["rope_parameters"] = {**rope, "mrope_section": list(TWIN_MROPE_SECTION)}
        # Rotary on a fraction of each head (GLM-4V-MoE: half): heads widened so the rotary part keeps its 8 dims
        fraction = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)) or 1.0
        if fraction < 1.0:
            text["head_dim"] = round(2 * sum(TWIN_MROPE_SECTION) / fraction)
    if model_type == "ernie4_5_vl_moe":  # text and image experts of their own widths, a list the shrink skips
        text["moe_intermediate_size"] = [32] * len(text["moe_intermediate_size"])
    if model_type == "hy_v4_vl" and not real_head_dims:  # latent attention: mRoPE rotates each head's rope part
        text["qk_rope_head_dim"] = text["head_dim"] = 2 * sum(TWIN_MROPE_SECTION)
    if model_type == "kimi_k25":  # its projector's norm reads the tower's width
        values["projection_hidden_size"] = vision["hidden_size"]
    if model_type in OMNI_THINKERS:  # the audio tower narrowed, its features as wide as the language model
        audio = values["audio_config"]
        audio.update({name: size for name, size in TWIN_AUDIO.items() if name in audio}, output_dim=hidden)
    # Tokens around each image that a default config leaves unset (Qwen-Omni's thinkers; a checkpoint names them):
    # past the vocabulary, which remap_special_tokens moves below its end with the other special tokens
    for offset, name in enumerate(FAMILIES[model_type].image_bounds or ()):
        if values.get(name) is None:
            values[name] = text["vocab_size"] + offset
    _image_geometry(model_type, values)


def _image_geometry(model_type: str, values: dict) -> None:
    """Each family's images shrunk to a few tokens (in place)."""
    vision, text = values["vision_config"], values["text_config"]
    hidden = text["hidden_size"]
    if model_type in ("gemma3", "shieldgemma2"):  # 4 x 4 patches pooled to 2 x 2 tokens
        vision["image_size"], values["mm_tokens_per_image"] = 4 * vision["patch_size"], 4
    elif model_type in ("llava", "vipllava", "video_llava"):  # 2 x 2 patches, one token each
        vision["image_size"], values["image_seq_length"] = 2 * vision["patch_size"], 4
        if model_type == "vipllava":  # its projector reads several vision layers: the twin's two
            values["vision_feature_layers"] = [-1, 0]
    elif model_type in ("idefics3", "smolvlm"):  # 2 x 2 tokens of scale_factor^2 patches each
        vision["image_size"] = 2 * vision["patch_size"] * values["scale_factor"]
    elif model_type == "idefics2":  # 2 x 2 patches, resampled to 4 latent tokens as wide as the language model
        vision["image_size"] = 2 * vision["patch_size"]
        values["perceiver_config"].update(resampler_n_latents=4, hidden_size=hidden)
    elif model_type in ANYRES:  # tiles of 2 x 2 patches, in grids of 1 x 1, 1 x 2, 2 x 1
        side = vision["image_size"] = 2 * vision["patch_size"]
        values["image_grid_pinpoints"] = [[side * rows, side * columns] for rows, columns in TWIN_TILE_GRIDS]
        if model_type == "llava_onevision":
            values["vision_aspect_ratio"] = "anyres_max_2"
    elif model_type in ("internvl", "qianfan_ocr"):  # tiles of 4 x 4 patches, pixel-shuffled to 4 tokens
        patch = vision["patch_size"][0]
        vision["image_size"], values["image_seq_length"] = [4 * patch, 4 * patch], 4
    elif model_type in ("aya_vision", "cohere2_vision"):  # tiles of 4 x 4 patches, pixel-shuffled to 4 tokens
        vision["image_size"] = 4 * vision["patch_size"]
    elif model_type == "llama4":  # tiles of 4 x 4 patches, pixel-shuffled to 4 tokens
        vision["image_size"] = 4 * vision["patch_size"]
        vision["projector_input_dim"] = vision["projector_output_dim"] = vision["vision_output_dim"] = hidden
        # its adapter reads the pixel-shuffled patches at the tower's intermediate width
        vision["intermediate_size"] = round(vision["hidden_size"] / vision["pixel_shuffle_ratio"] ** 2)
    elif model_type == "lfm2_vl":  # up to 4 x 4 patches (SigLIP2's NaFlex), 2 x 2 of them per token
        vision["num_patches"], values["projector_hidden_size"] = (
            max(rows * columns for rows, columns in TWIN_PATCH_GRIDS),
            hidden,
        )
    elif vision.get("model_type") == "pixtral":  # images of up to 8 x 8 patches, merged 2 x 2
        vision["image_size"] = 8 * vision["patch_size"]
    elif FAMILIES[model_type].layout == "navit":  # MiniCPM-V: crops of up to 8 x 8 patches
        vision["image_size"] = 8 * vision["patch_size"]
        # A default config leaves its image token unset (a checkpoint's config names it): one past the vocabulary,
        # which remap_special_tokens moves below its end with the other special tokens
        if values.get("image_token_id") is None:
            values["image_token_id"] = text["vocab_size"]
    else:
        _encoder_geometry(model_type, values)


def _encoder_geometry(model_type: str, values: dict) -> None:
    """`_image_geometry` for the families whose towers need more than their image size set."""
    vision, text = values["vision_config"], values["text_config"]
    hidden = text["hidden_size"]
    if model_type in GEMMA4:  # images of up to 2 x 2 tokens of pooling_kernel_size^2 patches, 2-pixel patches
        vision["patch_size"] = 2
        vision["position_embedding_size"] = 2 * vision["pooling_kernel_size"]
        if model_type in MERGED_PATCHES:  # its patch embedding as wide as the language model, positions per token
            vision["mm_embed_dim"] = vision["output_proj_dims"] = hidden
            vision["mm_posemb_size"] = 3
    elif model_type in TOKEN_PER_PATCH:  # 2 x 2 patches, a token each
        vision["image_size"] = 2 * vision["patch_size"]
        high_res = values.get("high_res_vision_config")
        if high_res is not None:  # SAM on 4 x 4 patches, in windows of 2 x 2, its features resized to SigLIP's grid
            high_res.update(image_size=4 * high_res["patch_size"], window_size=2, output_channels=8)
        if model_type == "janus":  # its aligner and its image generator's (a VQ-VAE, unused here) as wide as the text
            vision.update(num_image_tokens=4, projection_dim=hidden)
            values["vq_config"].update(
                projection_dim=hidden, image_token_embed_dim=hidden, num_embeddings=16, base_channels=32,
                latent_channels=32,
            )  # fmt: skip
    elif model_type == "granite4_vision":  # LLaVA-NeXT's tiles of 4 x 4 patches, queried by 2 x 2
        side = vision["image_size"] = 4 * vision["patch_size"]
        values["image_grid_pinpoints"] = [[side * rows, side * columns] for rows, columns in TWIN_TILE_GRIDS]
        values["downsample_rate"] = "2/4"
        # Its Q-Former takes a head per 64 of the tower's width (Granite4VisionConfig)
        vision["hidden_size"] = values["qformer_config"]["hidden_size"] = 64
        values["qformer_config"].update(encoder_hidden_size=64, num_attention_heads=1)
        if values.get("deepstack_layer_map") is None:  # the default config names none: the tower's last layer's
            values["deepstack_layer_map"] = [[-1, 0]]
    elif model_type in ("got_ocr2", "pp_chart2table"):  # SAM on 8 x 8 patches (windows of 2 x 2), 4 x 4 per token
        vision.update(image_size=8 * vision["patch_size"], window_size=2, output_channels=8)
        values["image_seq_length"] = 4
    elif model_type == "aria":  # 2 x 2 patches, queried by 4
        vision["image_size"] = 2 * vision["patch_size"]
        values["projector_patch_to_query_dict"] = {4: 4}
        # its image token (9) is a low id, among the check's random text: past the vocabulary, remapped to its end
        values["image_token_index"] = text["vocab_size"]
    elif model_type == "ovis2":  # tiles of 2 x 2 tokens of hidden_stride^2 patches each
        vision["image_size"] = 2 * vision["hidden_stride"] * vision["patch_size"]


def has_position_function(model_type: str) -> bool:
    """Whether `model_type`'s model places its tokens with its own position function (`get_rope_index`, found as
    modeling/vision.py's `position_function` finds it at run time: on its inner model)."""
    name = base_model_class_names().get(model_type)
    model_class = getattr(transformers, name, None) if name is not None else None
    return callable(getattr(model_class, "get_rope_index", None))


def twin_image_inputs(
    twin: torch.nn.Module, family: ImageFamily, images_per_example: list[int], seed: int
) -> tuple[dict, list[int]]:
    """Random image inputs for a batch of examples holding `images_per_example` images each, laid out as the family's
    processor and TRL's vision collator lay them out (every example's images on its chosen row, then again on its
    rejected row), and the image tokens each image of an example takes (example by example): from the twin's
    geometry, or where they depend on the image's size, from the twin's own image features."""
    config = twin.config
    vision = config.vision_config
    generator = torch.Generator().manual_seed(seed)
    images = sum(images_per_example)

    def noise(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    if family.layout == "patches":
        return _patch_images(config, images, noise)
    if family.layout == "navit":  # every crop's patches along the last axis, a grid per crop
        patch, channels = vision.patch_size, vision.num_channels
        grids = torch.tensor([TWIN_CROP_GRIDS[index % len(TWIN_CROP_GRIDS)] for index in range(images)])
        pixels = noise(1, channels, patch, int(grids.prod(-1).sum()) * patch)
        with torch.no_grad():
            features = twin.model.get_image_features(pixels, grids.int()).pooler_output
        inputs = {"pixel_values": torch.cat([pixels, pixels], dim=-1), "target_sizes": torch.cat([grids, grids]).int()}
        return inputs, [len(crop) for crop in features]
    if family.layout == "sized":
        inputs = _sized_images(config, images, noise)
        if config.model_type == "llava_onevision":  # a prompt of several images gets their base tiles only
            inputs["batch_num_images"] = torch.tensor(images_per_example)
        with torch.no_grad():
            features = _image_features(twin.model.get_image_features(**inputs))
        tokens = [len(image) for image in features]
        return {key: torch.cat([value, value]) for key, value in inputs.items()}, tokens
    side, channels = _side(vision.image_size), getattr(vision, "num_channels", 3)
    if family.layout == "tiles":
        tiles = [TWIN_TILES[index % len(TWIN_TILES)] for index in range(images)]
        pixels = noise(sum(tiles), channels, side, side)
        return {"pixel_values": torch.cat([pixels, pixels])}, [count * _fixed_tokens(config) for count in tiles]
    tokens = [_fixed_tokens(config)] * images
    if family.layout == "images":
        pixels = noise(images, channels, side, side)
        inputs = {"pixel_values": torch.cat([pixels, pixels])}
        high_res = getattr(config, "high_res_vision_config", None)
        if high_res is not None:  # DeepSeek-VL hybrid: each image again, at its high-resolution tower's size
            high_res_pixels = noise(images, high_res.num_channels, high_res.image_size, high_res.image_size)
            inputs["high_res_pixel_values"] = torch.cat([high_res_pixels, high_res_pixels])
        return inputs, tokens
    most = max(images_per_example)
    pixels = torch.zeros(len(images_per_example), most, channels, side, side, dtype=torch.float64)
    mask = torch.zeros(len(images_per_example), most, side, side, dtype=torch.bool)
    for row, count in enumerate(images_per_example):
        pixels[row, :count] = noise(count, channels, side, side)
        mask[row, :count] = True
    return {"pixel_values": torch.cat([pixels, pixels]), "pixel_attention_mask": torch.cat([mask, mask])}, tokens


def _patch_images(config, images: int, noise) -> tuple[dict, list[int]]:
    """Qwen-VL's layout: every image's patches, a grid per image (`image_grid_thw`), and each image's tokens."""
    vision = config.vision_config
    merge = _patch_merge(vision)
    grids = torch.tensor([TWIN_GRIDS[index % len(TWIN_GRIDS)] for index in range(images)])
    grids[:, 1:] *= merge
    pixels = noise(int(grids.prod(-1).sum()), *_patch_pixels(config.model_type, vision))
    inputs = {"pixel_values": torch.cat([pixels, pixels]), "image_grid_thw": torch.cat([grids, grids])}
    tokens = grids.prod(-1) // merge**2
    if config.model_type in NEWLINE_PER_ROW:
        tokens = grids[:, 0] * (grids[:, 1] // merge) * (grids[:, 2] // merge + 1)
    return inputs, tokens.tolist()


def _patch_merge(vision) -> int:
    """Patches merged per side into one image token (Kimi K2.5 names it a merge kernel)."""
    kernel = getattr(vision, "merge_kernel_size", None)
    return kernel[0] if kernel is not None else vision.spatial_merge_size


def _patch_pixels(model_type: str, vision) -> tuple[int, ...]:
    """The shape of one patch's pixel_values entry: flattened, or where the tower embeds patches by a 2-D convolution
    its processor leaves them (channels, patch, patch)."""
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    channels *= getattr(vision, "temporal_patch_size", 1)
    if model_type in UNFLATTENED_PATCHES:
        return channels, vision.patch_size, vision.patch_size
    return (channels * vision.patch_size**2,)


def _image_features(output) -> list[torch.Tensor]:
    """Each image's features from `get_image_features`: its `pooler_output`, or where it only adds features inside the
    language model (Granite 4 Vision's deepstack, `(layer, per-image features)` pairs), the first layer's."""
    if output.get("pooler_output") is not None:
        return output.pooler_output
    return output.deepstack_features[0][1]


def _side(image_size) -> int:
    return image_size[0] if isinstance(image_size, (list, tuple)) else image_size


def _sized_images(config, images: int, noise) -> dict[str, torch.Tensor]:
    """Images of different sizes, with `image_sizes`, as LLaVA-NeXT's and Pixtral's processors give them: LLaVA-NeXT's
    as a base tile and its any-resolution tiles (padded to the most tiles), Pixtral's padded to the largest image."""
    vision = config.vision_config
    grids = [TWIN_TILE_GRIDS[index % len(TWIN_TILE_GRIDS)] for index in range(images)]
    side, channels = getattr(vision, "image_size", None), getattr(vision, "num_channels", 3)
    if config.model_type == "lfm2_vl":  # every image's patches flattened, padded to the most, with their grid
        patch = vision.patch_size
        shapes = torch.tensor([TWIN_PATCH_GRIDS[index % len(TWIN_PATCH_GRIDS)] for index in range(images)])
        pixels = torch.zeros(images, vision.num_patches, channels * patch**2, dtype=torch.float64)
        mask = torch.zeros(images, vision.num_patches, dtype=torch.long)
        for image, patches in enumerate(shapes.prod(-1).tolist()):
            pixels[image, :patches], mask[image, :patches] = noise(patches, channels * patch**2), 1
        return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": shapes}
    if config.model_type in GEMMA4:  # grids of k x k patches per token, every image padded to the largest's patches
        pool, width = vision.pooling_kernel_size, 3 * vision.patch_size**2
        if config.model_type in MERGED_PATCHES:  # each token one patch of k x k patches' pixels
            pool, width = 1, width * pool**2
        token_grids = TWIN_WINDOW_GRIDS_2D if FAMILIES[config.model_type].images_past_window else TWIN_GRIDS_2D
        most = pool**2 * max(rows * columns for rows, columns in token_grids)
        pixels = torch.zeros(images, most, width, dtype=torch.float64)
        positions = torch.full((images, most, 2), -1, dtype=torch.long)
        for image in range(images):
            rows, columns = (pool * side for side in token_grids[image % len(token_grids)])
            y, x = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
            pixels[image, : rows * columns] = noise(rows * columns, width)
            positions[image, : rows * columns] = torch.stack([x.flatten(), y.flatten()], -1)
        return {"pixel_values": pixels, "image_position_ids": positions}
    if vision.model_type == "pixtral":  # each grid cell 2 x 2 merged patches
        side = 2 * vision.patch_size * config.spatial_merge_size
        pixels = torch.zeros(images, channels, 2 * side, 2 * side, dtype=torch.float64)
        for image, (rows, columns) in enumerate(grids):
            pixels[image, :, : rows * side, : columns * side] = noise(channels, rows * side, columns * side)
    else:
        most = 1 + max(rows * columns for rows, columns in grids)
        pixels = torch.zeros(images, most, channels, side, side, dtype=torch.float64)
        for image, (rows, columns) in enumerate(grids):
            pixels[image, : 1 + rows * columns] = noise(1 + rows * columns, channels, side, side)
    sizes = torch.tensor([[rows * side, columns * side] for rows, columns in grids])
    return {"pixel_values": pixels, "image_sizes": sizes}


def _fixed_tokens(config) -> int:
    """Image tokens per image of a fixed-size family's twin (its geometry, `twin_geometry`)."""
    for name in ("mm_tokens_per_image", "image_seq_length"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    if getattr(config, "projector_patch_to_query_dict", None):  # Aria: the queries for the image's patches
        patches = (_side(config.vision_config.image_size) // _side(config.vision_config.patch_size)) ** 2
        return config.projector_patch_to_query_dict[patches]
    if getattr(config, "perceiver_config", None) is not None:  # Idefics2: a resampler's latents
        return config.perceiver_config.resampler_n_latents
    vision = config.vision_config
    if config.model_type in TOKEN_PER_PATCH:
        return (_side(vision.image_size) // _side(vision.patch_size)) ** 2
    # pixel shuffle: Idefics3's scale factor, Aya Vision's downsample factor, Llama 4's ratio
    factor = getattr(config, "scale_factor", None) or getattr(config, "downsample_factor", None)
    factor = factor or getattr(vision, "hidden_stride", None)  # Ovis 2's patches per token, on a side
    factor = factor or round(1 / vision.pixel_shuffle_ratio)
    return (_side(vision.image_size) // _side(vision.patch_size)) ** 2 // factor**2
