"""Refusals of rows split over ranks (DeepSpeed Ulysses, context parallelism) and of engines that need every process
to call the same modules (ZeRO-3 on per-image loops and per-sequence mixers)."""

from __future__ import annotations

from collections.abc import Sequence

from .models import PADFREE_VARLEN

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


def check_dynamic_context_parallel_setup(ulysses_size: int, vision_dataset: bool) -> None:
    """`dynamic_context_parallel` shares a group's ranks out among rows of different rank counts each micro-step."""
    if ulysses_size > 1:
        raise ValueError(
            f"dynamic_context_parallel=True cannot run with Ulysses (sequence_parallel_size={ulysses_size}): Ulysses "
            "splits every row's heads over the same fixed group, so rows cannot take fewer ranks. Set "
            "sequence_parallel_size=1 (context parallelism alone), or dynamic_context_parallel=False."
        )
    if vision_dataset:
        raise ValueError(
            "dynamic_context_parallel=True splits text rows only: a vision-language row's images are dealt over the "
            "ranks of a fixed group. Set dynamic_context_parallel=False (static context parallelism splits image "
            "rows)."
        )
