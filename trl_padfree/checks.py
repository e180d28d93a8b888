"""Every refusal of padding-free training, in one place: what is refused, why, and what to do instead.

Each rule is one function that raises `ValueError` with advice that works when followed; the trainer, the config and
the forward call these where the information is first known. Whether a model's architecture packs is measured on a
tiny twin of it (architecture.py); the rules below turn that measurement into a decision.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .attention import ATTN_IMPLEMENTATION

if TYPE_CHECKING:
    from .architecture import Verdict

logger = logging.getLogger(__name__)

# Backends that keep packed sequences apart when the architecture allows: ours, flash varlen (cu_seq_lens), and the
# block-diagonal mask sdpa/eager build from position_ids when no attention mask is passed
FLASH_VARLEN = ("flash_attention_2", "flash_attention_3")
PACKING_AWARE_ATTENTION = (ATTN_IMPLEMENTATION, *FLASH_VARLEN, "sdpa", "eager")
# The backends a twin can run on a CPU, in the order advice offers them
CHECKED_ATTENTION = (ATTN_IMPLEMENTATION, "sdpa", "eager")


def resolve_attn_implementation(requested: str, current: str | None, prefix_sharing: bool = False) -> str:
    """`auto` keeps a flash varlen kernel the model already uses, else picks `padfree_varlen`; `keep` keeps `current`.

    Prefix sharing needs `padfree_varlen`, the one attention that reads the shared layout: `auto` picks it always.
    """
    if requested == "auto":
        return current if current in FLASH_VARLEN and not prefix_sharing else ATTN_IMPLEMENTATION
    resolved = current if requested == "keep" else requested
    if prefix_sharing and resolved != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"prefix_sharing=True needs the `{ATTN_IMPLEMENTATION}` attention (PyTorch's varlen kernel on CUDA, exact "
            f"per-segment attention on CPU), which lets rejected tokens attend to their prompt; {resolved!r} would "
            f"treat each rejected branch as a sequence of its own. Set packed_attn_implementation='auto' (or "
            f"'{ATTN_IMPLEMENTATION}'), or prefix_sharing=False."
        )
    return resolved


def choose_packed_attention(model: torch.nn.Module, requested: str, prefix_sharing: bool = False) -> str:
    """The attention `model` runs packed rows with: `resolve_attn_implementation`, except that `auto` moves on to
    `sdpa`, then `eager`, for an architecture the check finds exact on those but not on `padfree_varlen` (classes
    that keep their own attention code, such as GPT-Neo). The choice is logged; nothing inexact is chosen:
    `check_packable` still decides."""
    resolved = resolve_attn_implementation(requested, model.config._attn_implementation, prefix_sharing)
    if requested != "auto" or prefix_sharing or resolved != ATTN_IMPLEMENTATION:
        return resolved
    if architecture_verdict(model, resolved).exact:
        return resolved
    for backend in ("sdpa", "eager"):
        if architecture_verdict(model, backend).exact:
            logger.info(
                f"packed_attn_implementation='auto': {type(model).__name__} does not pack on `{resolved}` "
                f"({architecture_verdict(model, resolved).reason}); it packs exactly on `{backend}`, which it will use."
            )
            return backend
    return resolved


def check_attention_switched(model: torch.nn.Module, attn_implementation: str) -> None:
    # Some classes keep their own attention code and only log that they cannot switch
    if model.config._attn_implementation != attn_implementation:
        raise ValueError(
            f"{type(model).__name__} did not switch to attn_implementation={attn_implementation!r} (it stays on "
            f"{model.config._attn_implementation!r}). Set packed_attn_implementation='auto', which picks an attention "
            "the architecture check finds exact, or padding_free=False."
        )


def check_attn_implementation(attn_implementation: str | None) -> None:
    if attn_implementation not in PACKING_AWARE_ATTENTION:
        raise ValueError(
            f"padding_free=True cannot run with attn_implementation={attn_implementation!r}: it is not known to keep "
            f"packed sequences apart. Use one of {list(PACKING_AWARE_ATTENTION)} (set `packed_attn_implementation`), "
            "or padding_free=False."
        )


def checked_backend(attn_implementation: str) -> str:
    """The backend a twin runs for `attn_implementation`: flash kernels need a GPU and half precision, so their
    architecture is checked on `padfree_varlen`, which reads the same `cu_seq_lens` with the same varlen semantics."""
    return ATTN_IMPLEMENTATION if attn_implementation in FLASH_VARLEN else attn_implementation


def architecture_verdict(
    model: torch.nn.Module, attn_implementation: str | None = None, prefix_sharing: bool = False
) -> Verdict:
    """Whether `model`'s architecture packs exactly on `attn_implementation` (default: the model's own), measured on
    its tiny twin and cached per architecture: the model's weights, dtype and partitioning play no part."""
    # Imported here: the architecture check runs the packed forward (forward.py), which imports these refusals
    from .architecture import check_architecture

    attn_implementation = attn_implementation or model.config._attn_implementation
    return check_architecture(type(model), model.config, checked_backend(attn_implementation), prefix_sharing)


def check_packable(
    model: torch.nn.Module, prefix_sharing: bool = False, attn_implementation: str | None = None
) -> None:
    """Refuse a model whose packed forward on `attn_implementation` (default: the model's own) would differ from its
    per-sequence forward, as measured on a tiny twin of its architecture (architecture.py), naming the backends that
    would work."""
    attn_implementation = attn_implementation or model.config._attn_implementation
    check_attn_implementation(attn_implementation)
    verdict = architecture_verdict(model, attn_implementation, prefix_sharing)
    if verdict.exact:
        return
    raise ValueError(refusal_message(model, verdict, attn_implementation, prefix_sharing))


def refusal_message(model: torch.nn.Module, verdict: Verdict, attn_implementation: str, prefix_sharing: bool) -> str:
    # Refused only because of sharing when the same architecture packs without it
    sharing_alone = prefix_sharing and architecture_verdict(model, attn_implementation).exact
    what = "prefix_sharing=True" if sharing_alone else "padding_free=True"
    message = (
        f"{what} cannot train {verdict.model_class} (model type {verdict.model_type!r}) with "
        f"attn_implementation={attn_implementation!r}: {verdict.reason}."
    )
    if what == "prefix_sharing=True":
        return f"{message} Set prefix_sharing=False (padding-free training without sharing packs it exactly)."
    working = [
        backend
        for backend in CHECKED_ATTENTION
        if backend != verdict.attn_implementation
        and not (prefix_sharing and backend != ATTN_IMPLEMENTATION)
        and architecture_verdict(model, backend, prefix_sharing).exact
    ]
    if working:
        return (
            f"{message} It packs exactly with packed_attn_implementation={working[0]!r} (checked the same way); set "
            "that, or padding_free=False."
        )
    return f"{message} Train it with padding_free=False."


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


def check_prefix_sharing_without_sequence_parallel(prefix_sharing: bool, sequence_parallel: bool) -> None:
    if prefix_sharing and sequence_parallel:
        raise ValueError(
            "prefix_sharing=True does not work with sequence parallelism yet: a shared prompt and the rejected "
            "branch that reads it could land on different ranks. Set prefix_sharing=False, or sequence_parallel_size=1."
        )


def check_not_prompt_learning(peft_config) -> None:
    if peft_config.is_prompt_learning:
        raise ValueError(
            "padding_free=True does not support prompt-learning PEFT methods (prompt/prefix/p-tuning): their "
            "virtual tokens would be prepended once to the packed row instead of to every sequence. Use LoRA, "
            "or padding_free=False."
        )


def packed_row_limit(config) -> int | None:
    """The longest packed row that stays exact for this architecture, or None when any length does.

    Llama 4's NoPE layers scale queries by their index in the row ("attention temperature tuning"), not by their
    position in their sequence: the scale is 1 for indices below `floor_scale - 1` (8191), so rows up to that length
    equal each sequence alone. The architecture check's short sequences cannot see this.
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    floor_scale = getattr(text_config, "floor_scale", None)
    if getattr(text_config, "attn_temperature_tuning", False) and floor_scale:
        return int(floor_scale) - 1
    return None


def check_packed_row_length(config, row_length: int) -> None:
    limit = packed_row_limit(config)
    if limit is not None and row_length > limit:
        raise ValueError(
            f"A packed row of {row_length} tokens is too long for {config.get_text_config().model_type!r}: its "
            f"attention temperature tuning scales queries by their index in the row, which equals their position "
            f"in their sequence only in rows of at most {limit} tokens. Lower per_device_train_batch_size, or set "
            f"max_tokens_per_batch <= {limit}, or train with padding_free=False."
        )


def check_packing_collator(data_collator) -> None:
    from .collator import PaddingFreePreferenceCollator

    if not (isinstance(data_collator, PaddingFreePreferenceCollator) and data_collator.padding_free):
        raise ValueError(
            f"padding_free=True needs packed batches, but the data collator is {type(data_collator).__name__}. "
            "Pass `PaddingFreePreferenceCollator(...)` (padding_free=True), or no collator at all."
        )


def refuse_vision_datasets() -> None:
    raise ValueError("padding_free=True is not supported for vision datasets. Set padding_free=False.")


def check_sequence_parallel_setup(
    sp_size: int, deepspeed: bool, padding_free: bool, disable_dropout: bool, aux_loss_enabled: bool
) -> None:
    """Sequence parallelism (DeepSpeed Ulysses over a packed row): what it needs from the run's settings."""
    if not deepspeed:
        raise ValueError(
            f"Sequence parallelism (sp_size={sp_size}) runs on DeepSpeed Ulysses, not under FSDP or plain data "
            "parallelism: launch with a DeepSpeed config, e.g. `accelerate launch --config_file "
            "recipes/accelerate_configs/zero3_sp2.yaml ...`. ZeRO-3 shards the policy as FSDP2 does (docs/fsdp.md)."
        )
    if not padding_free:
        raise ValueError(
            f"Sequence parallelism (sp_size={sp_size}) needs padding_free=True: it splits one packed row over the "
            "group, with per-sequence positions that TRL's padded batches do not carry. Set padding_free=True."
        )
    if not disable_dropout:
        raise ValueError(
            "Sequence parallelism runs the reference model in training mode (DeepSpeed switches Ulysses off in "
            "eval mode), so its dropout must be off: set disable_dropout=True."
        )
    check_split_rows_without_moe_aux_loss("Sequence parallelism", "sp_size=1", aux_loss_enabled)


def check_context_parallel_config(size: int, padding_free: bool) -> None:
    """`context_parallel_size` (context_parallel.py): what the config must say."""
    if size < 1:
        raise ValueError(f"context_parallel_size must be at least 1, got {size}.")
    if size == 1:
        return
    if not padding_free:
        raise ValueError(
            f"context_parallel_size={size} needs padding_free=True: it splits one packed row over the group. Set "
            "padding_free=True."
        )


def check_context_parallel_setup(size: int, world_size: int, attn_implementation: str, aux_loss_enabled: bool) -> None:
    """Context parallelism at trainer set-up: the processes and the model it needs (`size`: ranks per row, with
    Ulysses' factor)."""
    if world_size % size:
        raise ValueError(
            f"context_parallel_size x sequence_parallel_size = {size} must divide the number of processes, "
            f"{world_size}: each group of {size} consecutive processes shares one packed row. Launch a multiple of "
            f"it, e.g. `--num_processes {size}`."
        )
    if attn_implementation != "padfree_varlen":
        raise ValueError(
            f"Context parallelism runs in the `padfree_varlen` attention, which attends each rank's chunk to the "
            f"row's gathered keys; this model runs {attn_implementation!r}. Set packed_attn_implementation='auto' "
            "(or 'padfree_varlen')."
        )
    check_split_rows_without_moe_aux_loss("Context parallelism", "context_parallel_size=1", aux_loss_enabled)


def check_split_rows_without_moe_aux_loss(feature: str, way_out: str, aux_loss_enabled: bool) -> None:
    """A row split over ranks: each rank's router logits are those of its chunk alone."""
    if aux_loss_enabled:
        raise ValueError(
            f"{feature} with a Mixture-of-Experts auxiliary loss would weigh each rank's chunk of the row alone. Set "
            f"router_aux_loss_coef=0, or {way_out}."
        )


def check_no_context_parallelism(cp_size: int) -> None:
    """accelerate's context parallelism (`parallelism_config` cp_size, FSDP2 with torch's ring attention) splits the
    row and runs causal SDPA over it as one sequence: the sequences of a packed row would see each other."""
    if cp_size > 1:
        raise ValueError(
            f"accelerate's context parallelism (cp_size={cp_size}) is not supported with padding_free=True: its "
            "ring attention treats the packed row as one causal sequence, so each sequence would attend to the ones "
            "before it. Set cp_size=1 and, to split long pairs over GPUs, use sequence parallelism on DeepSpeed "
            "(sequence_parallel_size, recipes/accelerate_configs/zero3_sp2.yaml)."
        )


def check_sequence_parallel_without_stateful_mixers(mixer_classes) -> None:
    """Sequence and context parallelism hand each rank a chunk of the row: a mixer that carries state along the row
    would restart at every chunk boundary, inside sequences."""
    if mixer_classes:
        raise ValueError(
            f"Sequence or context parallelism cannot split this model's rows: its {', '.join(mixer_classes)} layers "
            "carry state along the row, and each rank would start its chunk from no state. Set sp_size=1 and "
            "context_parallel_size=1 (the model trains padding-free on one device per row), or use a model without "
            "linear-attention or state-space layers."
        )


def check_no_liger_kernel(use_liger_kernel: bool) -> None:
    """TRL's Liger path computes the loss from the base model's hidden states on its padded batch, bypassing the
    packed forward."""
    if use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True cannot train padding-free: TRL's Liger DPO loss runs the base model on the padded "
            "batch itself, outside the packed forward. Set use_liger_kernel=False (padding-free rows hold no padding "
            "for Liger's fused loss to save), or padding_free=False to train with Liger."
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


def check_token_budget_setup(padding_free: bool, sp_size: int, train_dataset) -> None:
    """Token-budget batching (`max_tokens_per_batch`): what it needs from the run's settings."""
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
    if isinstance(train_dataset, torch.utils.data.IterableDataset):
        raise ValueError("max_tokens_per_batch needs a training dataset with a length, not an IterableDataset.")
