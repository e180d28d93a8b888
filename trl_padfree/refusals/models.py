"""Refusals of a model and its attention, decided once at the trainer's set-up: the attention, the architecture
check's verdict, the longest exact row, adapters, TRL's fused LM head, the MoE auxiliary loss, Liger."""

from __future__ import annotations

from collections.abc import Sequence

PADFREE_VARLEN = "padfree_varlen"  # the attention this package registers (modeling/backends.py)

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
