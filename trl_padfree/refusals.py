"""Every refusal of padding-free training, in one place: what is refused, why, and what to do instead.

Each rule is one function of plain values that raises `ValueError` (a setting to change) or `RuntimeError` (a library
that no longer does what the pinned version did) with advice that works when followed; the config, the trainer, the
forward and the engines call these where the information is first known. This module imports nothing of the package,
so a rule cannot grow a second copy elsewhere. Whether a model's architecture packs is measured on a tiny twin of it
(modeling/packability.py), which turns that measurement into a refusal here.
"""

from __future__ import annotations

from collections.abc import Sequence

PADFREE_VARLEN = "padfree_varlen"  # the attention this package registers (modeling/backends.py)

# ---- the config ----


def check_at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")


def check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}.")


def check_prefix_sharing_value(value, known: bool) -> None:
    if not known:
        raise ValueError(f"prefix_sharing must be true, false or 'auto', got {value!r}.")


def check_fp32_log_probs_value(value, known: bool) -> None:
    if not known:
        raise ValueError(f"fp32_log_probs must be true, false or unset (None: auto), got {value!r}.")


def check_prefix_sharing_config(prefix_sharing: bool, padding_free: bool, min_prompt_tokens: int) -> None:
    if prefix_sharing and not padding_free:
        raise ValueError(
            f"prefix_sharing={prefix_sharing!r} needs padding_free=True: the shared layout is a packed row. Set "
            "padding_free=True."
        )
    if min_prompt_tokens < 2:
        raise ValueError(
            "prefix_sharing_min_prompt_tokens must be at least 2 (the prefix is the prompt but its last token), "
            f"got {min_prompt_tokens}."
        )


def check_sequence_parallel_sizes_agree(configured: int, launched: int) -> None:
    if launched > 1 and configured not in (1, launched):
        raise ValueError(
            f"sequence_parallel_size={configured} disagrees with the accelerate config's "
            f"parallelism_config_sp_size={launched}. Set one of them."
        )


def check_sequence_parallel_not_under_fsdp(sp_size: int, fsdp_version: int | None) -> None:
    # accelerate itself refuses this later, with an error about dp_shard_size that names neither option
    if sp_size > 1 and fsdp_version is not None:
        raise ValueError(
            f"sequence_parallel_size={sp_size} is not supported under FSDP (fsdp_version {fsdp_version}): sequence "
            "parallelism runs on DeepSpeed Ulysses. Launch with a DeepSpeed config "
            "(`trl-padfree dpo --accelerate_config zero3_sp2`; ZeRO-3 shards the policy as FSDP2 does), or set "
            "sequence_parallel_size=1."
        )


def check_context_parallel_config(size: int, padding_free: bool) -> None:
    """`context_parallel_size` (parallel/context.py): what the config must say."""
    check_at_least_one("context_parallel_size", size)
    if size > 1 and not padding_free:
        raise ValueError(
            f"context_parallel_size={size} needs padding_free=True: it splits one packed row over the group. Set "
            "padding_free=True."
        )


# ---- models and attention ----


def check_attn_implementation(attn_implementation: str | None, packing_aware: Sequence[str]) -> None:
    if attn_implementation not in packing_aware:
        raise ValueError(
            f"padding_free=True cannot run with attn_implementation={attn_implementation!r}: it is not known to keep "
            f"packed sequences apart. Use one of {list(packing_aware)} (set `packed_attn_implementation`), "
            "or padding_free=False."
        )


def check_prefix_sharing_attention(attn_implementation: str | None) -> None:
    """Prefix sharing needs `padfree_varlen`, the one attention that reads the shared layout."""
    if attn_implementation != PADFREE_VARLEN:
        raise ValueError(
            f"prefix_sharing=True needs the `{PADFREE_VARLEN}` attention (PyTorch's varlen kernel on CUDA, exact "
            f"per-segment attention on CPU), which lets rejected tokens attend to their prompt; {attn_implementation!r} "
            f"would treat each rejected branch as a sequence of its own. Set packed_attn_implementation='auto' (or "
            f"'{PADFREE_VARLEN}'), or prefix_sharing=False."
        )


def check_attention_switched(model_class: str, requested: str, running: str | None) -> None:
    # Some classes keep their own attention code and only log that they cannot switch
    if running != requested:
        raise ValueError(
            f"{model_class} did not switch to attn_implementation={requested!r} (it stays on {running!r}). Set "
            "packed_attn_implementation='auto', which picks an attention the architecture check finds exact, or "
            "padding_free=False."
        )


def refuse_architecture(
    what: str, model_class: str, model_type: str, attn_implementation: str, reason: str, working: Sequence[str]
) -> None:
    """A model the architecture check finds inexact (`what` is the setting refused: padding_free or prefix_sharing),
    with the backends that pass the same check."""
    message = (
        f"{what}=True cannot train {model_class} (model type {model_type!r}) with "
        f"attn_implementation={attn_implementation!r}: {reason}."
    )
    if what == "prefix_sharing":
        message += " Set prefix_sharing=False (padding-free training without sharing packs it exactly)."
    elif working:
        message += (
            f" It packs exactly with packed_attn_implementation={working[0]!r} (checked the same way); set that, or "
            "padding_free=False."
        )
    else:
        message += " Train it with padding_free=False."
    raise ValueError(message)


def check_packed_row_length(model_type: str, row_length: int, limit: int | None) -> None:
    """Llama 4's NoPE layers scale queries by their index in the row: exact only up to `limit` tokens."""
    if limit is not None and row_length > limit:
        raise ValueError(
            f"A packed row of {row_length} tokens is too long for {model_type!r}: its attention temperature tuning "
            f"scales queries by their index in the row, which equals their position in their sequence only in rows "
            f"of at most {limit} tokens. Lower per_device_train_batch_size, or set max_tokens_per_batch <= {limit}, "
            "or train with padding_free=False."
        )


def check_not_prompt_learning(is_prompt_learning: bool) -> None:
    if is_prompt_learning:
        raise ValueError(
            "padding_free=True does not support prompt-learning PEFT methods (prompt/prefix/p-tuning): their "
            "virtual tokens would be prepended once to the packed row instead of to every sequence. Use LoRA, "
            "or padding_free=False."
        )


def check_fused_lm_head_backbone(model_class: str, backbone: str, prefix: str, children: Sequence[str]) -> None:
    """TRL's fused LM head runs `model.base_model`: `backbone` names what that is, "" when it is a decoder stack."""
    if backbone:
        raise ValueError(
            f"TRL's fused LM head runs `model.base_model` as the decoder stack, but {model_class}.base_model is "
            f"{backbone} (base_model_prefix {prefix!r}), and its PreTrainedModel children {list(children)} do not "
            "name exactly one decoder to use instead. Set `model.base_model_prefix` to the attribute holding the "
            "decoder stack."
        )


def check_fused_lm_head_output(model_class: str, has_weight: bool) -> None:
    if not has_weight:
        raise ValueError(
            f"TRL's fused LM head multiplies the hidden states by `model.get_output_embeddings().weight`, but "
            f"{model_class} has no output embedding with a weight."
        )


def check_fused_lm_head_experts(model_class: str, config_class: str, missing: str | None, looked_in) -> None:
    if missing is not None:
        raise ValueError(
            f"{model_class} returns router logits, and TRL's fused LM head computes the MoE auxiliary loss from "
            f"`config.{missing}`, which {config_class} does not hold (the expert count was looked for under "
            f"{tuple(looked_in)}). Set `router_aux_loss_coef=0` in the DPOConfig and `output_router_logits=False` in "
            "the model config to train without the auxiliary loss."
        )


def check_moe_aux_loss_without_row_padding(aux_loss_enabled: bool, pad_to_multiple_of: int | None) -> None:
    # The load-balancing loss averages the router outputs of every token of the row: padding would count
    if aux_loss_enabled and pad_to_multiple_of:
        raise ValueError(
            "padding_free=True with a Mixture-of-Experts auxiliary loss and `pad_to_multiple_of` would count the "
            "row padding in the load-balancing loss. Unset `pad_to_multiple_of`."
        )


def check_prefix_sharing_without_moe_aux_loss(prefix_sharing: bool, aux_loss_enabled: bool) -> None:
    if prefix_sharing and aux_loss_enabled:
        raise ValueError(
            "prefix_sharing=True with a Mixture-of-Experts auxiliary loss would count each prompt's router "
            "outputs once instead of twice in the load-balancing loss. Set router_aux_loss_coef=0, or "
            "prefix_sharing=False."
        )


def check_no_liger_kernel(use_liger_kernel: bool) -> None:
    """TRL's Liger path computes the loss from the base model's hidden states on its padded batch."""
    if use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True cannot train padding-free: TRL's Liger DPO loss runs the base model on the padded "
            "batch itself, outside the packed forward. Set use_liger_kernel=False (padding-free rows hold no padding "
            "for Liger's fused loss to save), or padding_free=False to train with Liger."
        )


# ---- vision-language batches ----


def check_image_tokens(example: int, images: int, image_tokens: int) -> None:
    """Each sequence's image placeholders and images must come together: features are placed on the placeholders."""
    if images and not image_tokens:
        raise ValueError(
            f"Example {example} of the batch has {images} image(s) but no image placeholder in its text, so the model "
            "has nowhere to put them. Put the images in the prompt (a conversational prompt with {'type': 'image'} "
            "parts, or the processor's image token in a plain prompt), or remove them from the example."
        )
    if image_tokens and not images:
        raise ValueError(
            f"Example {example} of the batch has {image_tokens} image tokens in its text but no image: the model would "
            "read the placeholders as text and train on them. Give the example its images (an `images` list) or "
            "remove the image tokens from its text."
        )


def refuse_truncated_image(example: int, image_tokens: int, kept: int, needed: int, max_length: int) -> None:
    """TRL's vision collator cuts every sequence to its first `max_length` tokens; an image must survive whole."""
    raise ValueError(
        f"max_length={max_length} cuts the images of example {example} of the batch: {kept} of its {image_tokens} "
        f"image tokens are within the first {max_length} tokens, and the model would get an image without its "
        f"placeholders (TRL's padded trainer fails there with 'Image features and image tokens do not match'). Set "
        f"max_length to at least {needed} (or None), use smaller images, or drop such examples."
    )


def check_image_inputs_layout(sizes: dict[str, int], expected: int, unit: str) -> None:
    """Each image input must be cut into the parts each sequence holds (packing/vision.py)."""
    wrong = {key: size for key, size in sizes.items() if size != expected}
    if wrong:
        raise ValueError(
            f"trl-padfree cannot tell which image inputs belong to which sequence: from this processor's keys it "
            f"expects {expected} {unit} in each, but found {wrong}. Train with padding_free=False (TRL pads, and "
            "packs nothing)."
        )


# ---- the preference data, as TRL will read it ----

PREFERENCE_FORMATS = "https://huggingface.co/docs/trl/dataset_formats"


def check_pair_columns(dataset: str, columns: Sequence[str], row: int | None = None) -> None:
    """TRL's DPO reads `chosen` and `rejected` from every row (`row`: the row read, in a stream whose rows can
    differ), and `prompt` unless the prompt is implicit (the start both completions share, TRL's `extract_prompt`)."""
    missing = [name for name in ("chosen", "rejected") if name not in columns]
    if missing:
        where = dataset if row is None else f"{dataset}, row {row},"
        raise ValueError(
            f"{where} has no {' and no '.join(repr(name) for name in missing)} column (its columns: "
            f"{sorted(columns)}). TRL's DPO reads preference pairs: 'chosen' and 'rejected', and 'prompt' unless both "
            f"completions start with it ({PREFERENCE_FORMATS}#preference). Rename or add the columns."
        )


def check_pair_value(
    dataset: str, row: int, column: str, found: str, expected: Sequence[str], format_set_by: str | None
) -> None:
    """A prompt or completion as TRL reads it: `found` (what the value is, in words) must be one of `expected` ("a
    string", "a list of messages"): the one the first row set (`format_set_by` says how), as TRL reads every row in
    the format of the first, or either where the first row set none."""
    if found in expected:
        return
    why = f" ({format_set_by}, and TRL reads every row in the format of the first)" if format_set_by else ""
    raise ValueError(
        f"{dataset}, row {row}, column {column!r}: {found}, where {' or '.join(expected)} is expected{why}; TRL would "
        "fail on it inside its tokenization. Fix the row or drop it (`dataset.filter(...)`): a prompt or completion "
        "is a string (plain text) or a list of {'role': ..., 'content': ...} messages (conversational), one of the "
        f"two in every row and column ({PREFERENCE_FORMATS})."
    )


def check_image_column(dataset: str, column: str, why_no_images: str | None) -> None:
    """A dataset with an image column (TRL's `image` or `images`) needs a model that takes images; `why_no_images`
    says why this one does not, or is None."""
    if why_no_images is not None:
        raise ValueError(
            f"{dataset} has an image column {column!r}, but the model takes no images: {why_no_images}. Train a "
            "vision-language model (with its processor), or drop the column "
            f"(`dataset.remove_columns({column!r})`) to train on the text."
        )


def check_image_columns_agree(dataset: str, column: str, training_images: bool) -> None:
    """TRL prepares every dataset as it prepares the training set: text-only unless the training set has images."""
    if not training_images:
        raise ValueError(
            f"{dataset} has an image column {column!r}, but train_dataset has none: TRL prepares every dataset the "
            "way it prepares train_dataset, as text, and would evaluate without these images. Give train_dataset its "
            f"images too, or drop the column (`dataset.remove_columns({column!r})`)."
        )


# ---- batches ----


def check_packing_collator(collator_name: str, packs: bool) -> None:
    if not packs:
        raise ValueError(
            f"padding_free=True needs packed batches, but the data collator is {collator_name}. Pass "
            "`PaddingFreePreferenceCollator(...)` (padding_free=True), or no collator at all."
        )


def check_packed_batch_expected(padding_free: bool) -> None:
    if not padding_free:
        raise ValueError(
            "Got a packed batch (from PaddingFreePreferenceCollator) but padding_free=False. Set "
            "`padding_free=True` in the config, or use TRL's padded collator."
        )


def check_examples(count: int, missing_by_example: Sequence[tuple[int, list[str], list[str]]]) -> None:
    """A preference batch: not empty; `missing_by_example` lists (index, missing columns, columns it has)."""
    if not count:
        raise ValueError("The preference collator received an empty batch.")
    for index, missing, has in missing_by_example:
        raise KeyError(
            f"Example {index} of the batch has no {missing} column(s); got {sorted(has)}. The collator expects "
            "tokenized preference data: let DPOTrainer tokenize a `prompt`/`chosen`/`rejected` dataset, or provide "
            "`prompt_ids`, `chosen_ids` and `rejected_ids` yourself."
        )


def check_reference_log_probs(paired_on_all_or_none: bool, first_non_finite: tuple[int, tuple] | None) -> None:
    if not paired_on_all_or_none:
        raise ValueError(
            "Reference log-probs must come as a pair (`ref_chosen_logps` and `ref_rejected_logps`) on every example of "
            "the batch or on none. Recompute them (e.g. `precompute_ref_log_probs=True`) or drop both columns."
        )
    if first_non_finite is not None:
        index, values = first_non_finite
        raise ValueError(
            f"Example {index} has reference log-probs {values}: each must be one finite number per sequence. "
            "Recompute them with the same tokenizer, `max_length` and `truncation_mode` as training."
        )


def check_truncation_mode(truncation_mode: str) -> None:
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"Unsupported truncation mode: {truncation_mode}, expected 'keep_start' or 'keep_end'")


def check_no_empty_sequence(shortest: int) -> None:
    if shortest == 0:
        raise ValueError(
            "A sequence of the batch is empty (no prompt and no completion tokens). Remove such pairs from the dataset."
        )


def check_datasets_not_empty(sizes: dict[str, int | None], max_length: int | None) -> None:
    # TRL drops examples whose prompt alone fills `max_length`; with none left, torch's sampler fails obscurely
    for name, size in sizes.items():
        if size == 0:
            raise ValueError(
                f"The {name} dataset has no examples left: it was empty, or TRL dropped every example because its "
                f"prompt alone fills max_length={max_length}. Check the data, or increase `max_length` (or shorten "
                "the prompts)."
            )


def check_batches_not_dispatched(dispatch_batches: bool | None, split_batches: bool) -> None:
    """accelerate's dispatcher concatenates and slices every tensor of a batch along its first dimension: a packed
    batch is one row of varying length with per-sequence tensors beside it, so neither survives."""
    if dispatch_batches:
        raise ValueError(
            "accelerator_config.dispatch_batches=True cannot carry packed batches: accelerate concatenates the "
            "processes' batches and slices every tensor to the batch size of the first, cutting the per-sequence "
            "lengths of a packed row. Set dispatch_batches=False (each process then builds its own rows; a streamed "
            "dataset is read by every process, each keeping its share)."
        )
    if split_batches:
        raise ValueError(
            "accelerator_config.split_batches=True cannot split a packed batch: it is one row, not a batch of rows. "
            "Set split_batches=False and per_device_train_batch_size to the pairs each process trains on."
        )


# ---- the packed forward and its attention ----


def check_no_cache(live_cache: bool) -> None:
    if live_cache:
        raise ValueError(
            "A packed forward cannot use a KV cache: with a cache, transformers ignores the packed position_ids and "
            "every sequence of the row attends to the ones before it. Call the model with `use_cache=False`."
        )


def check_no_padding_mask(padded: bool) -> None:
    """`padfree_varlen` honours no attention mask: a padded batch would let real tokens attend to padding."""
    if padded:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention got a padded batch (an attention mask with zeros), which it cannot honour. "
            "Pass packed rows without a mask, or switch the model back for padded inputs, e.g. "
            "`model.set_attn_implementation('sdpa')` before `generate`."
        )


def check_attention_call(
    has_mask: bool, rows: int, queries: int, keys: int, boundaries_known: bool, causal: bool, sinks: int | None, heads
) -> None:
    """One call of `padfree_varlen`: one packed row of causal self-attention, its boundaries known."""
    if has_mask:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention is for packed rows and takes no attention mask; this batch is padded. "
            "Use the padding-free collator, or `sdpa` for padded batches."
        )
    if not boundaries_known:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention needs `cu_seq_lens_q` or the `position_ids` of one packed row; pass the "
            "batch of `PaddingFreePreferenceCollator` to the model."
        )
    if rows != 1 or queries != keys:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention expects one packed row of self-attention (no cache); got {rows} rows, "
            f"{queries} queries and {keys} keys."
        )
    if sinks is not None and sinks != heads:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention needs one attention sink per query head: got {sinks} sinks for {heads} "
            "heads."
        )
    if not causal:
        raise ValueError(f"`{PADFREE_VARLEN}` attention only supports causal (decoder) self-attention.")


def check_chunked_layer(module_class: str, layer_idx: int | None, chunk_size: int | None) -> None:
    """A chunked attention layer (`layer_idx` None: the config has chunked layers, the module no index)."""
    if layer_idx is None:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention cannot tell whether this {module_class} is a chunked attention layer: its "
            "config has chunked layers but the module has no `layer_idx`."
        )
    if not chunk_size:
        raise ValueError(
            f"Layer {layer_idx} is a chunked attention layer, but its config sets no attention_chunk_size."
        )


def refuse_prefix_sharing_with_chunked_layers() -> None:
    # A rejected branch's chunks are counted from the start of its prompt, which its row segment does not hold
    raise ValueError("prefix sharing with chunked attention layers is not supported; set prefix_sharing=False.")


def refuse_image_spans_with_chunked_layers() -> None:
    raise ValueError(
        "A model with chunked attention layers cannot train padding-free on images that attend to themselves both "
        "ways (Gemma 3's): no such model exists in transformers, so the combination is not implemented. Set "
        "padding_free=False."
    )


def refuse_layout_not_received(layout: str, keyword: str, consequence: str, way_out: str) -> None:
    """An attention call during a forward whose row layout (prefix sharing, context parallelism) it did not get."""
    raise ValueError(
        f"This model's attention layers did not receive the {layout} (`{keyword}`), so {consequence}. Its model type "
        f"does not pass keyword arguments down to attention; set {way_out} for it."
    )


def refuse_layout_not_read(layout: str, consequence: str, way_out: str) -> None:
    """A forward whose row layout no attention call read: the model mixes tokens without the attention interface."""
    raise ValueError(
        f"No attention layer of this model read the {layout}, so {consequence}. The model does not run its attention "
        f"through `{PADFREE_VARLEN}` with transformers' keyword arguments; set {way_out}."
    )


def check_mixer_segments(mixer_class: str, packed_without_segments: bool) -> None:
    if packed_without_segments:
        raise ValueError(
            f"{mixer_class} got a packed row without its sequence boundaries: a packed forward of this model must go "
            "through trl_padfree's packed forward (`model(..., packed_batch=...)`)."
        )


def check_mixer_conv_width(mixer_class: str, width: int, refusing_kernel: tuple[str, str] | None) -> None:
    """`refusing_kernel`: (the resolved convolution kernel, its pip distribution) when it refuses this width."""
    if refusing_kernel is not None:
        kernel, distribution = refusing_kernel
        raise ValueError(
            f"{mixer_class} layers convolve over {width} tokens, and transformers hands them to {kernel}, which takes "
            f"widths 2 to 4 only: the model fails in transformers itself, padded or packed. Uninstall {distribution} "
            "(transformers then runs its PyTorch convolution)."
        )


def check_mixer_inputs(mixer_class: str, live_cache: bool, has_mask: bool) -> None:
    if live_cache:
        raise ValueError(f"{mixer_class}: a packed forward runs without a cache (use_cache=False).")
    if has_mask:
        raise ValueError(f"{mixer_class}: a packed row carries no attention mask; its boundaries are the segments.")


# ---- sequence and context parallelism ----


def check_prefix_sharing_without_sequence_parallel(prefix_sharing: bool, sequence_parallel: bool) -> None:
    if prefix_sharing and sequence_parallel:
        raise ValueError(
            "prefix_sharing=True does not work with sequence parallelism yet: a shared prompt and the rejected "
            "branch that reads it could land on different ranks. Set prefix_sharing=False, or sequence_parallel_size=1."
        )


def check_sequence_parallel_engine(sp_size: int, deepspeed: bool, padding_free: bool, zero_stage: int | None) -> None:
    """Ulysses runs under DeepSpeed ZeRO-3 only. Under ZeRO-1 and ZeRO-2 (deepspeed 0.19.8) the step applies sp_size
    times the gradient, and logs and clips sp_size times its norm (docs/guides/long-sequences.md, measured): refused."""
    if not deepspeed:
        raise ValueError(
            f"Sequence parallelism (sp_size={sp_size}) runs on DeepSpeed Ulysses, not under FSDP or plain data "
            "parallelism: launch with a DeepSpeed config, e.g. `trl-padfree dpo --accelerate_config zero3_sp2 ...`. "
            "ZeRO-3 shards the policy as FSDP2 does (docs/guides/multi-gpu.md)."
        )
    if zero_stage != 3:
        raise ValueError(
            f"Sequence parallelism (sp_size={sp_size}) needs DeepSpeed ZeRO-3, but the DeepSpeed config has zero "
            f"stage {zero_stage}: under ZeRO-1 and ZeRO-2 the optimizer step applies sp_size times the gradient "
            "(docs/guides/long-sequences.md). Set `zero_stage: 3` in the accelerate config (e.g. "
            "the shipped zero3_sp2 config), or split rows with context_parallel_size instead, which "
            "works under any engine."
        )
    if not padding_free:
        raise ValueError(
            f"Sequence parallelism (sp_size={sp_size}) needs padding_free=True: it splits one packed row over the "
            "group, with per-sequence positions that TRL's padded batches do not carry. Set padding_free=True."
        )


def check_ulysses_without_dropout(disable_dropout: bool, attention_dropout: float) -> None:
    """Ulysses runs the reference model in training mode (DeepSpeed switches it off in eval mode, which would attend
    within each rank's chunk only), so no dropout may act there."""
    if not disable_dropout:
        raise ValueError(
            "Sequence parallelism runs the reference model in training mode (DeepSpeed switches Ulysses off in "
            "eval mode), so its dropout must be off: set disable_dropout=True."
        )
    if attention_dropout:
        raise ValueError(
            "Sequence parallelism runs the reference model's attention in training mode (DeepSpeed switches Ulysses "
            "off in eval mode, which would attend within each rank's chunk only), so attention dropout must be 0: "
            f"the model has attention_dropout={attention_dropout}. Set it to 0."
        )


def check_ulysses_attention(attn_implementation: str, sp_size: int, exact_under_ulysses: Sequence[str]) -> None:
    if attn_implementation not in exact_under_ulysses:
        raise ValueError(
            f"Sequence parallelism (sp_size={sp_size}) cannot run attn_implementation={attn_implementation!r} "
            "exactly on packed rows: under DeepSpeed Ulysses it attends across the sequences of the row. Use "
            f"`packed_attn_implementation` 'auto' or one of {list(exact_under_ulysses)}."
        )


def check_ulysses_heads(heads: int, kv_heads: int, sp_size: int) -> None:
    if heads % sp_size:
        raise ValueError(
            f"Sequence parallelism splits attention heads over the group: {heads} attention heads are not divisible "
            f"by sp_size={sp_size}. Choose an sp_size that divides {heads}."
        )
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ValueError(
            f"Sequence parallelism needs the {kv_heads} key-value heads to be divisible by sp_size={sp_size} (or "
            "sp_size by them, when DeepSpeed replicates them). Choose another sp_size."
        )


def check_ulysses_head_dims(head_dims: Sequence[int], ulysses_head_dim: int) -> None:
    """DeepSpeed's Ulysses (0.18-0.19, `UlyssesSPAttentionHF`) exchanges every attention layer's query, key and value
    at one head size, read once from the config (`head_dim`, else the hidden size over the heads): layers of another
    width, or a value narrower than the query, fail inside its exchange or its setup."""
    others = sorted(set(head_dims) - {ulysses_head_dim})
    if others:
        raise ValueError(
            f"Sequence parallelism cannot split this model's rows: DeepSpeed's Ulysses exchanges every attention "
            f"layer's query, key and value at one head size, {ulysses_head_dim} (read from its config), but its "
            f"attention has head dims {sorted(set(head_dims))} (layers of several widths, as Gemma 4's global "
            "layers, or latent attention's query and value of different widths). Split rows with "
            "context_parallel_size instead (any head dims), or set sequence_parallel_size=1."
        )


def check_no_sequence_parallel_groups_yet(created: bool) -> None:
    """DeepSpeed creates its sequence-parallel groups, and wraps the attention function for Ulysses, once per process:
    a second sequence-parallel trainer in the same process would fail deep inside `train()`."""
    if created:
        raise RuntimeError(
            "DeepSpeed sets up sequence parallelism once per process, and an earlier trainer in this process already "
            "did. Run each sequence-parallel training in its own `accelerate launch`."
        )


def check_processes_share_rows(ranks_per_row: int, world_size: int) -> None:
    if world_size % ranks_per_row:
        raise ValueError(
            f"context_parallel_size x sequence_parallel_size = {ranks_per_row} must divide the number of processes, "
            f"{world_size}: each group of {ranks_per_row} consecutive processes shares one packed row. Launch a "
            f"multiple of it, e.g. `--num_processes {ranks_per_row}`."
        )


def check_context_parallel_attention(attn_implementation: str | None) -> None:
    if attn_implementation != PADFREE_VARLEN:
        raise ValueError(
            f"Context parallelism runs in the `{PADFREE_VARLEN}` attention, which attends each rank's chunk to the "
            f"row's gathered keys; this model runs {attn_implementation!r}. Set packed_attn_implementation='auto' "
            f"(or '{PADFREE_VARLEN}')."
        )


def check_split_rows_without_moe_aux_loss(feature: str, way_out: str, aux_loss_enabled: bool) -> None:
    """A row split over ranks: each rank's router logits are those of its chunk alone."""
    if aux_loss_enabled:
        raise ValueError(
            f"{feature} with a Mixture-of-Experts auxiliary loss would weigh each rank's chunk of the row alone. Set "
            f"router_aux_loss_coef=0, or {way_out}."
        )


def check_fsdp2_vision_lm_head(vision_language: bool, tied_lm_head: bool) -> None:
    """FSDP2 on a vision-language model whose LM head is its own weight: accelerate wraps that head as an FSDP unit of
    its own (it looks for the final norm among the inner model's children, which for a VLM are the towers), and TRL's
    fused LM head reads `lm_head.weight` without calling `lm_head`, so the unit never gathers: its gradient is wrong."""
    if vision_language and not tied_lm_head:
        raise ValueError(
            "FSDP2 would train this vision-language model's LM head wrong: accelerate shards the untied `lm_head` as "
            "an FSDP unit of its own, and TRL's fused LM head reads `lm_head.weight` without calling the module, so "
            "the unit's weight is never gathered and its gradient is not averaged over the processes (measured on "
            "tiny Idefics3 with 2 processes: 0.089 off; TRL's padded trainer gets the same wrong numbers). Train it "
            "with DeepSpeed ZeRO-3 (`trl-padfree dpo --accelerate_config zero3`), which equals "
            "one process on such models."
        )


def check_zero3_per_image_loop(
    model_class: str,
    loop: tuple[str, str] | None,
    zero_stage: int | None,
    row_groups: int,
    dealt_over: int,
    tied_lm_head: bool,
) -> None:
    """DeepSpeed ZeRO-3 on a vision-language model whose forward runs a module's layers once per image or crop
    (`loop`: the module and the unit; modeling/vision.py). ZeRO-3 gathers a layer's weights at each call and checks
    that every process called its modules in the same order, so every process must run as many images: not so when
    the processes hold different rows (`row_groups` > 1, data parallelism), nor when a row's images are dealt over its
    `dealt_over` processes (`deal_images`), whose shares can hold different numbers. TRL's padded trainer runs the
    same loop over data-parallel processes (measured: it fails the same way)."""
    if loop is None or zero_stage != 3 or (row_groups < 2 and dealt_over < 2):
        return
    module, unit = loop
    why = (
        f"its `{module}` runs its layers once per {unit}, and ZeRO-3 gathers their weights at each call, so processes "
        f"holding different numbers of {unit}s issue different collectives (on CPU processes gloo aborts with a "
        "'collective mismatch' or hangs; on GPUs NCCL would hang)"
    )
    if row_groups < 2:
        raise ValueError(
            f"DeepSpeed ZeRO-3 cannot deal {model_class}'s images over the {dealt_over} processes of a row: {why}, "
            "and the shares of a row's images can hold different numbers. Set deal_images=False: every process of the "
            "row then encodes all of its images."
        )
    if tied_lm_head:
        way_out = (
            "FSDP2 (`trl-padfree dpo --accelerate_config fsdp2`), which gathers that module once per forward with the "
            "unit holding it, or DeepSpeed ZeRO-2 (`--accelerate_config zero2`), which gathers nothing, where the "
            "parameters fit whole on each GPU"
        )
    else:
        way_out = (
            "DeepSpeed ZeRO-2 (`trl-padfree dpo --accelerate_config zero2`), which gathers nothing (the parameters "
            "whole on each GPU); FSDP2 is refused for this model's untied LM head"
        )
    raise ValueError(
        f"DeepSpeed ZeRO-3 cannot train {model_class} on images over processes holding different rows: {why}. TRL's "
        f"padded trainer (padding_free=False) fails the same way. Train it with {way_out}."
    )


def check_zero3_mixer_calls(mixer_classes: Sequence[str], zero_stage: int | None, processes: int, uneven: str) -> None:
    """DeepSpeed ZeRO-3 on a model whose stateful mixers run once per sequence of the packed row
    (`modeling.mixers.mixers_run_per_segment`), with batches that give processes different numbers of pairs
    (`uneven`: the option that does). ZeRO-3 gathers a layer's weights at each call and checks that every process
    called its modules in the same order, so every process must run as many sequences."""
    if not mixer_classes or zero_stage != 3 or processes < 2 or not uneven:
        return
    raise ValueError(
        f"DeepSpeed ZeRO-3 cannot train this model with {uneven} over {processes} processes: its "
        f"{', '.join(mixer_classes)} layers run once per sequence of the packed row (no kernel here takes a whole "
        "row with its boundaries), ZeRO-3 gathers their weights at each call, and these batches give processes "
        "different numbers of pairs, so the processes issue different collectives (on CPU gloo aborts with a "
        "'collective mismatch'; on GPUs NCCL would hang). Use one of: per_device_train_batch_size batches (unset "
        "max_tokens_per_batch, train_sampling_strategy='random'); FSDP2 (`trl-padfree dpo --accelerate_config "
        "fsdp2`), which gathers a decoder layer once per forward; DeepSpeed ZeRO-2 (`--accelerate_config zero2`); or, "
        'on CUDA, the kernels that run a whole row (`pip install "trl-padfree[hybrid-kernels]"`: causal-conv1d, '
        "flash-linear-attention, mamba-ssm)."
    )


def check_image_within_window(past_window: tuple[int, int] | None) -> None:
    """Gemma 4 Unified's image tokens see their whole image on sliding-window layers, past the window too; the packed
    attention bounds them by the window, as Gemma 3's are: the same for images no longer than the window."""
    if past_window is not None:
        tokens, window = past_window
        raise ValueError(
            f"An image of {tokens} tokens is longer than this model's sliding window ({window}): its tokens see the "
            "whole image past the window, which the packed attention does not compute. Use images of at most "
            f"{window} tokens (the image processor's max_soft_tokens), or set padding_free=False."
        )


def check_split_image_spans(bidirectional_images: bool, context_parallel: bool) -> None:
    """Context parallelism attends each rank's chunk to the gathered keys, causally within each sequence: an image
    whose tokens attend to the whole image (Gemma 3) would need its later tokens, which may sit on another rank."""
    if bidirectional_images and context_parallel:
        raise ValueError(
            "Context parallelism cannot split this vision-language row: its image tokens attend to their whole image "
            "both ways (Gemma 3), and the context-parallel attention is causal within each sequence. Use Ulysses "
            "sequence parallelism instead (sp_size > 1, context_parallel_size=1), which attends over the whole row."
        )


def check_split_rows_without_stateful_mixers(mixer_classes: Sequence[str]) -> None:
    """Sequence and context parallelism hand each rank a chunk of the row: a mixer that carries state along the row
    would restart at every chunk boundary, inside sequences."""
    if mixer_classes:
        raise ValueError(
            f"Sequence or context parallelism cannot split this model's rows: its {', '.join(mixer_classes)} layers "
            "carry state along the row, and each rank would start its chunk from no state. Set sp_size=1 and "
            "context_parallel_size=1 (the model trains padding-free on one device per row), or use a model without "
            "linear-attention or state-space layers."
        )


def check_no_context_parallelism(cp_size: int) -> None:
    """accelerate's context parallelism (FSDP2 with torch's ring attention) runs causal SDPA over the row as one
    sequence: the sequences of a packed row would see each other."""
    if cp_size > 1:
        raise ValueError(
            f"accelerate's context parallelism (cp_size={cp_size}) is not supported with padding_free=True: its "
            "ring attention treats the packed row as one causal sequence, so each sequence would attend to the ones "
            f"before it. Set context_parallel_size={cp_size} in the DPO config instead (trl-padfree's context "
            "parallelism keeps the sequences apart, on any engine), launched with an accelerate config without "
            "parallelism_config_cp_size (for FSDP2, the shipped one: `trl-padfree dpo --accelerate_config fsdp2`); "
            "or, on DeepSpeed ZeRO-3 with attention heads that divide by it, sequence_parallel_size "
            "(`trl-padfree dpo --accelerate_config zero3_sp2`)."
        )


# ---- token-budget batching ----


def check_token_budget_setup(padding_free: bool, sp_size: int, streamed: bool) -> None:
    if not padding_free:
        raise ValueError(
            "max_tokens_per_batch needs padding_free=True: a padded micro-batch costs pairs x longest sequence, "
            "not its tokens. Set padding_free=True."
        )
    if sp_size > 1:
        raise ValueError(
            "max_tokens_per_batch does not work with sequence parallelism yet. Unset one of them; with sequence "
            "parallelism, size rows with per_device_train_batch_size and max_length."
        )
    if streamed:
        raise ValueError("max_tokens_per_batch needs a training dataset with a length, not an IterableDataset.")


# TRL's loss types whose value for a pair depends on the other pairs of its micro-batch: balancing changes which pairs
# share a micro-batch, so these would train on other numbers than padded TRL's
COUPLED_LOSS_TYPES = {
    "aot": "sorts the micro-batch's log-ratios and pairs them by rank",
    "aot_unpaired": "sorts the micro-batch's chosen and rejected log-ratios and pairs them by rank",
    "sft": "is the mean over all of the micro-batch's chosen tokens, weighing a pair by its tokens",
}


def check_balanced_batches_setup(
    loss_types: Sequence[str], aux_loss: bool, budget_with_split_rows: bool, sized: bool, seedable: bool = True
) -> None:
    """`train_sampling_strategy="batch_rebalance"` under padding-free: what balancing cannot keep exact."""
    coupled = [loss_type for loss_type in loss_types if loss_type in COUPLED_LOSS_TYPES]
    if coupled:
        reasons = "; ".join(f"'{name}' {COUPLED_LOSS_TYPES[name]}" for name in coupled)
        raise ValueError(
            f"train_sampling_strategy='batch_rebalance' with padding_free=True cannot keep loss_type {coupled} equal "
            f"to padded TRL: {reasons}, and balancing changes which pairs share a micro-batch. Use "
            "train_sampling_strategy='random' (the default) with this loss, or a loss computed per pair."
        )
    if aux_loss:
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' with padding_free=True cannot keep the router's auxiliary loss "
            "equal to padded TRL: it is a statistic of each micro-batch's tokens, and balancing changes which pairs "
            "share a micro-batch. Set output_router_logits=False in the model config, or use "
            "train_sampling_strategy='random'."
        )
    if budget_with_split_rows:
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' does not deal max_tokens_per_batch's micro-batches to row "
            "groups (sequence or context parallelism) yet. Use one of them: batch_rebalance with "
            "per_device_train_batch_size, or max_tokens_per_batch with train_sampling_strategy='random'."
        )
    if not sized:
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' needs a training dataset with a length, not an "
            "IterableDataset: each step's pairs are partitioned from their lengths."
        )
    if not seedable:
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' trains each step on the pairs accelerate's seedable sampler "
            "would give it (seed + epoch); with accelerator_config.use_seedable_sampler=False the default order is "
            "another one. Leave use_seedable_sampler at its default (True)."
        )


def check_balanced_batches_split(pairs: int, pairs_per_round: int, any_step: bool) -> None:
    if not any_step:
        raise ValueError(
            f"train_sampling_strategy='batch_rebalance' with dataloader_drop_last=True: a training set of {pairs} "
            f"pairs holds no whole round of {pairs_per_round} pairs (per_device_train_batch_size on every process), "
            "so every pair would be dropped. Set dataloader_drop_last=False, or use more pairs."
        )


def check_tokenized_pairs(missing: Sequence[str]) -> None:
    if missing:
        raise ValueError(
            f"Token-budget batching needs the tokenized pairs, but the training dataset has no {sorted(missing)} "
            "column(s). Pass a prompt/chosen/rejected dataset and let DPOTrainer tokenize it."
        )


def check_pairs_fit(
    too_long: int, longest: tuple[int, int], budget: int, capacity: int, max_length, images: bool = False
) -> None:
    """`too_long` pairs exceed the row's `capacity`; `longest` is (pair index, its row tokens)."""
    if too_long:
        index, tokens = longest
        # A shorter max_length would cut images, which is refused: on image data, only the budget or the data can give
        shorter = (
            "drop the longest pairs or shrink their images (their image tokens count)"
            if images
            else f"set max_length to at most {capacity // 2} so that TRL truncates every sequence to fit"
        )
        raise ValueError(
            f"{too_long} pair(s) of the training set do not fit max_tokens_per_batch={budget} (the longest, pair "
            f"{index}, has {tokens} tokens in the packed row: prompt + chosen and prompt + rejected, cut to "
            f"max_length={max_length}). Raise max_tokens_per_batch, or {shorter}."
        )


def check_budget_bins_share(bins: int, processes: int, splittable: bool) -> None:
    if not splittable:
        raise ValueError(
            f"Token-budget batching made {bins} micro-batches of one pair each, which cannot be shared evenly by "
            f"{processes} processes. Raise max_tokens_per_batch so that pairs share micro-batches."
        )


def check_training_set_not_empty(pairs: int) -> None:
    if not pairs:
        raise ValueError("Token-budget batching got an empty training set.")


# ---- where the reference model lives: DeepSpeed and FSDP ----


def check_ref_offload(
    zero_stage: int | None,
    fsdp_version: int | None,
    separate_reference: bool,
    peft: bool,
    precompute: bool,
) -> None:
    """`ref_offload=True` where it cannot apply, before anything is loaded. `zero_stage`: the DeepSpeed config's,
    None without DeepSpeed; `fsdp_version`: None without FSDP."""
    if zero_stage is None and fsdp_version is None:
        raise ValueError(
            "ref_offload=True needs DeepSpeed ZeRO-3 or FSDP2: launch with `trl-padfree dpo --accelerate_config zero3` "
            "or `--accelerate_config fsdp2` (or pass a stage-3 `deepspeed` config), or set ref_offload=False."
        )
    if fsdp_version is not None and fsdp_version != 2:
        raise ValueError(
            f"ref_offload=True under FSDP needs FSDP2, but the run asks for fsdp_version {fsdp_version}. Use "
            "the shipped fsdp2 config (`--accelerate_config fsdp2`, fsdp_version: 2), or set ref_offload=False."
        )
    if fsdp_version is None and zero_stage != 3:
        raise ValueError(
            f"ref_offload=True needs DeepSpeed ZeRO-3, but the DeepSpeed config has zero stage {zero_stage}: "
            "parameter offload exists only at stage 3 (TRL gives the reference stage 0 below it, a full copy per "
            "GPU). Use the shipped zero3 config (`--accelerate_config zero3`), or set ref_offload=False."
        )
    if not separate_reference and peft:
        raise ValueError(
            "ref_offload=True has no reference model to offload: with a PEFT adapter the reference is the policy "
            "with its adapter disabled, which costs no extra memory. Set ref_offload=False."
        )
    # Under FSDP TRL loads a reference to precompute with (the policy is not sharded yet), which is offloaded
    if not separate_reference and precompute and fsdp_version is None:
        raise ValueError(
            "ref_offload=True has no reference model to offload: with precompute_ref_log_probs=True and no "
            "`ref_model`, TRL computes the reference log-probs with the untrained policy before training and keeps "
            "no reference. Set ref_offload=False (or pass a `ref_model` to precompute with, offloaded and released "
            "after precomputation)."
        )


def check_reference_not_on_gpus(sharded_on_gpus: bool) -> None:
    if sharded_on_gpus:
        raise ValueError(
            "ref_offload=True got a reference model already sharded onto the GPUs by ZeRO-3 (it was loaded under "
            "the policy's DeepSpeed config, and DeepSpeed keeps parameters where they were first sharded). Pass no "
            "`ref_model` (the trainer then loads it offloaded), or load it outside the ZeRO-3 context."
        )


def check_reference_offloaded(offloaded: bool) -> None:
    """After TRL's `__init__`: the reference really is offloaded (TRL may stop calling the rerouted name)."""
    if not offloaded:
        raise RuntimeError(
            "ref_offload=True, but the reference model's parameters are not ZeRO-3 shards in CPU memory: this TRL "
            "version no longer prepares it through `trl.trainer.dpo_trainer.prepare_deepspeed`, which trl-padfree "
            "reroutes. Pin TRL to the tested range (pyproject.toml), or set ref_offload=False."
        )


def check_fsdp_engine(requested_version: int | None, fsdp_set_up: bool, distributed_type: str) -> None:
    """A run that asked for FSDP but got none: on CPU processes accelerate gives an FSDP config plain data
    parallelism (its distributed type there is MULTI_CPU), so nothing would be sharded."""
    if requested_version is not None and not fsdp_set_up:
        raise ValueError(
            f"This run asks for FSDP (fsdp_version {requested_version}) but accelerate set up {distributed_type}, "
            "which does not shard the model: accelerate runs FSDP only on GPUs (and other accelerators), and on CPU "
            "processes falls back to data parallelism. Launch on GPUs, or use a data-parallel config "
            "(`--accelerate_config multi_gpu`) for CPU runs."
        )


def check_reference_not_fsdp_wrapped(offload: bool) -> None:
    if offload:
        raise ValueError(
            "ref_offload=True got a reference model already wrapped by FSDP2, which trl-padfree cannot offload any "
            "more. Pass the unwrapped model (or none: TRL then loads it), or set ref_offload=False."
        )


def check_reference_sharded_by_layer(sharded_as_asked: bool, offload: bool) -> None:
    """After TRL's `__init__`: the reference went through trl-padfree's FSDP2 preparation."""
    if not sharded_as_asked:
        raise RuntimeError(
            "The reference model was not sharded by trl-padfree's FSDP2 preparation: this TRL version no longer "
            "prepares it through `trl.trainer.dpo_trainer.prepare_fsdp`, which trl-padfree reroutes. "
            + ("Its parameters are not offloaded to CPU memory. " if offload else "")
            + "Pin TRL to the tested range (pyproject.toml), or report it."
        )


def check_counted_pair_sizes(processor: str, pair: int, counted: list[int], collated: list[int]) -> None:
    """A pair counted from its image sizes (packing/pair_sizes.py) must lay out as collating it does: checked on the
    first pair of each process's share."""
    if counted != collated:
        raise ValueError(
            f"Pair {pair}'s row counted from its image sizes (chosen tokens, rejected tokens, shared prefix, scored "
            f"tokens: {counted}) differs from the row {processor} collates ({collated}): trl-padfree's image token "
            "count does not hold for this processor, and batches would be built on wrong lengths. Please report it "
            "with the processor's name; until then pass a processor subclass of your own (any class not derived from "
            "the Qwen-VL or LLaVA processors is priced by collating each pair)."
        )
