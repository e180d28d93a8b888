"""Image-text-to-text types that padding-free does not train on image data, each with its verdict, read from its
transformers source (modeling file, `forward`, `get_image_features`, processor).

- **refused**: looked at, and cannot pack: images reach the language model other than on placeholder tokens
  (cross-attention, a prefix shared by a whole batch row), the model is no causal LM for preference pairs, or its
  forward fails padded too. Each reason ends with what a user can do.
- **unchecked**: could pack, but the architecture check cannot give its twin images yet: what is missing, in one line.
  padding_free=True refuses them on image data; TRL's padded trainer (padding_free=False) trains them.

A type whose image layout is known has its record in that layout's module, whatever its verdict (so that a verdict
changes in one record); encoder-decoders and cross-attention configs are
refused from their configs (cli/models.py, modeling/vision.py). tests/test_architecture.py checks that every type of
`AutoModelForImageTextToText` has exactly one verdict.
"""

from __future__ import annotations

from .record import TRAIN_PADDED, refused, unchecked

FAMILIES = {
    "blip": refused(
        "its images reach a BERT text decoder through cross-attention in every layer, not on tokens; " + TRAIN_PADDED
    ),
    "evolla": refused(
        "a protein-text model: protein features reach the language model through cross-attention (its sequence "
        "aligner), and it takes no images; " + TRAIN_PADDED
    ),
    "git": refused(
        "its image features are a prefix of every batch row, not placed on placeholder tokens: a packed row would "
        "share one prefix between its sequences; " + TRAIN_PADDED
    ),
    "idefics": refused(
        "its images reach the language model through gated cross-attention every cross_layer_interval layers: "
        "every token attends to its whole row's images; " + TRAIN_PADDED
    ),
    "kosmos-2": refused(
        "its forward fails padded too: TRL's vision collator keeps image_embeds_position_mask at the prompt's "
        "width, and the forward raises IndexError on the full sequences; TRL 1.16 cannot train it on image pairs"
    ),
    "kosmos-2.5": refused(
        "its forward fails padded too: image_embeds_position_mask stays at the prompt's width (IndexError) "
        "and is built for right padding, while TRL pads left; TRL 1.16 cannot train it on image pairs"
    ),
    "diffusion_gemma": refused(
        "a block-diffusion model (a bidirectional decoder over a canvas): it gives no causal "
        "log-probs, so DPO cannot train it, padded or packed"
    ),
    "pi0": refused(
        "a robotics action model (flow matching over action chunks): no language-model log-probs, so DPO cannot "
        "train it, padded or packed"
    ),
    # PI05ForConditionalGeneration returns the velocities its action expert predicts over an action chunk as `logits`
    "pi05": refused(
        "a robotics action model (PI0's flow matching over action chunks, its action expert conditioned on the "
        "timestep): its logits are predicted action velocities, not language-model log-probs, so DPO cannot train it, "
        "padded or packed"
    ),
    # transformers 5.24's HunYuanVLModel.get_rope_index: its `image_index` runs on across the batch's rows
    "hunyuan_vl": refused(
        "its position function numbers images over the whole batch, not per sequence (an image's positions "
        "count the images of every sequence before it in the padded batch), so a sequence's log-probs depend on the "
        "sequences batched with it and packing cannot be checked against each sequence alone; " + TRAIN_PADDED
    ),
    # a prefix-LM: image and prompt tokens (token_type_ids 0) attend both ways, the completion (1) causally
    "paligemma": refused(
        "a prefix-LM: its image and prompt tokens attend to each other both ways and only its completion "
        "causally, and no packed form of that attention is built. TRL's vision collator cannot feed it with "
        "PaliGemmaProcessor either: it tokenizes the completions without images, which the processor refuses ('`images` "
        "are expected'), and would pass on the processor's `labels`. Train it padded (padding_free=False) with a "
        "processor that tokenizes text without images as a completion (token_type_ids 1) and returns no labels"
    ),
    "molmo2": refused(
        "its image tokens attend both ways to every image token of their sequence, across its images (one "
        "block, block_sequence_ids), and its image_token_pooling indexes the patches of the whole batch's crops: no packed "
        "form of either is built (packed attention opens each run of image tokens both ways, and the image layouts do not "
        "re-base pooling indices per sequence), so packed sequences would see each other's images; " + TRAIN_PADDED
    ),
    "mistral4": refused(
        "Mistral4ForCausalLM takes no images (no vision tower); on text data `trl-padfree models --types "
        "mistral4` gives its verdict"
    ),
    "perception_lm": unchecked(
        "a timm vision tower and an image processor that both need torchvision, and a default config "
        "that builds no model (its vision_config has no model_args)"
    ),
    "fast_vlm": unchecked("a timm vision tower (FastViT) that needs torchvision, which the check's environment lacks"),
    "blip-2": unchecked(
        "a fixed num_query_tokens Q-Former outputs per image, but its processor puts them before the left "
        "padding: positions that count the padding differ from a packed row's"
    ),
    "instructblip": unchecked(
        "as BLIP-2, with per-row Q-Former inputs (qformer_input_ids), equal to per-image only with one "
        "image per example"
    ),
    "instructblipvideo": unchecked(
        "a clip layout: each image becomes a 4-frame clip on 4 x num_query_tokens video tokens, which "
        "TRL's collator does not give it"
    ),
    "granite_docling": unchecked(
        "Idefics3's rows, but a 2-D per-tile pixel_attention_mask, which the rows layout does not cut"
    ),
    "fuyu": unchecked(
        "one row of pixel_values per image token (patches embedded linearly, no grid input): a layout cut by each "
        "row's placeholder count"
    ),
    "inkling_mm_model": unchecked(
        "Fuyu's one-pixel-row-per-image-token layout, and a twin of its language model (too large: "
        "its text row is refused)"
    ),
    "inkling2": unchecked(
        "image patches counted in language-model tokens (no merge), after its language model's twin, too "
        "large (its text row is refused)"
    ),
    "inkling2_loop": unchecked(
        "Inkling2's images, after its looped language model's packed forward runs on a twin (a dtype "
        "error: its text row is refused)"
    ),
    "muse_spark": unchecked(
        "Muse Glimmer's image patches and an audio tower: a twin branch; its image processor needs torchvision"
    ),
    "nemotron_h_omni": unchecked(
        "image patches keyed by image_grid_hw (two columns), no image_token_id in its default config, "
        "and no top-level lm_head"
    ),
    "deepseek_ocr2": unchecked("a crops layout: one global view per image and local crops split by num_local_patches"),
    "unlimited_ocr": unchecked(
        "DeepSeek-OCR-2's crops layout with a per-image patches_grid; its image processor needs torchvision"
    ),
    "step3p7": unchecked(
        "DeepSeek-OCR-2's crops layout (pixel_values_local split by num_local_patches); its image processor "
        "needs torchvision"
    ),
    "chameleon": unchecked(
        "a VQ model: images become ordinary token ids, but its default config has no vocabulary_map and "
        "builds no model; with images tokenized beforehand, the row is plain text"
    ),
    "emu3": unchecked(
        "a VQ model: images become ordinary token ids (its default config has no vocabulary_map); with images "
        "tokenized beforehand, the row is plain text, which packs exactly (Emu3ForCausalLM)"
    ),
    "apertus1p5": unchecked(
        "a VQ model: image codes embedded as text, a twin of its image and audio tokenizers; with images "
        "tokenized beforehand, the row is plain text"
    ),
    "qwen4_exp": unchecked(
        "a language model whose default config builds (qwen4_exp_text's fails: TypeError in a // of two "
        "None sizes, as its text row), then Qwen-VL-style image patches with its own position function and experts"
    ),
    "glm5_next": unchecked(
        "a packed form of its linear-attention layers (Glm5NextTextLinearAttention: the packed forward refuses "
        "them) before its image patches can be checked; its twin needs NoPE (qk_rope_head_dim 0) in its sparse attention"
    ),
    "cohere_compass": unchecked(
        "a language model whose default config builds (cohere_compass_text's fails: KeyError "
        "'full_attention', as its text row; its twin's rope_parameters are refused too), then image patches with DeepStack "
        "features and its own position function"
    ),
    "gemma3n": unchecked(
        "fixed image tokens from a MobileNet tower beside an audio tower and per-layer inputs: a twin branch"
    ),
}
