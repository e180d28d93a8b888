"""Sequence parallelism for packed rows on DeepSpeed Ulysses (ALST), set up by accelerate's
`ParallelismConfig(sp_backend="deepspeed", sp_size=N)`.

Every rank of a sequence-parallel group gets the same packed micro-batch. The row is padded to a multiple of N and
each rank feeds the model its own contiguous chunk; inside attention, DeepSpeed exchanges heads for sequence
(all-to-all), so each rank attends over the whole row for N-th of the heads, with the row's global `cu_seq_lens`
keeping sequences apart. The per-token outputs are then all-gathered (differentiably) back into the whole row, so
every rank computes the same per-sequence sums and the same DPO loss as without sequence parallelism:

    row    | chosen 1 | chosen 2 | rejected 1 | rejected 2 | pad |      padded to a multiple of N = 2
    rank 0 | ---- chunk 0 ----------|                                     input_ids, position_ids, shift_labels
    rank 1                          |---------- chunk 1 ------------|
    log-probs of both chunks all-gathered -> one row on every rank -> TRL's loss, unchanged

Gradients: each rank's loss reaches its own chunk through the all-gather, whose backward sums the N identical
contributions; DeepSpeed then averages gradients over all data- and sequence-parallel ranks, which divides them back.
"""

from __future__ import annotations

import contextlib

import torch

from ..integrations.deepspeed import sequence_parallel_group, sequence_parallel_groups_created
from ..refusals.parallel import (
    check_no_sequence_parallel_groups_yet,
    check_ulysses_attention,
    check_ulysses_head_dims,
    check_ulysses_heads,
)
from .groups import RowGroup


def sequence_parallel_size(accelerator) -> int:
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or config.sp_backend != "deepspeed":
        return 1
    return config.sp_size


def active_group(accelerator) -> RowGroup | None:
    """The sequence-parallel group of this rank once DeepSpeed has created it (at `accelerator.prepare`), else None."""
    if sequence_parallel_size(accelerator) == 1:
        return None
    # The groups DeepSpeed's Ulysses registration initialized (its `mpu`), which its attention uses
    return RowGroup(*sequence_parallel_group())


def check_ulysses_model(model_config, attn_implementation: str, sp_size: int, exact_under_ulysses) -> None:
    """What Ulysses cannot run exactly on a packed row: an attention that leaks across its sequences, head counts it
    cannot split, head dims it cannot exchange."""
    check_ulysses_attention(attn_implementation, sp_size, exact_under_ulysses)
    text_config = model_config.get_text_config()
    heads = text_config.num_attention_heads
    check_ulysses_heads(heads, getattr(text_config, "num_key_value_heads", None) or heads, sp_size)
    check_ulysses_head_dims(*attention_head_dims(text_config))


def attention_head_dims(text_config) -> tuple[set[int], int]:
    """The head dims of a language model's attention (query, key and value, every layer) as its config states them,
    and the one head size DeepSpeed's Ulysses reads from it (`head_dim`, else the hidden size over the heads)."""
    values = text_config.to_dict()  # Gemma 4's `head_dim` is per layer, which its attribute getter refuses
    ulysses_head_dim = values.get("head_dim") or text_config.hidden_size // text_config.num_attention_heads
    if values.get("qk_nope_head_dim") is not None and values.get("qk_rope_head_dim") is not None:
        # Multi-head latent attention: query and key of both parts, the value its own width
        query = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
        return {query, values.get("v_head_dim") or query}, ulysses_head_dim
    per_layer = [layer.get("head_dim") for layer in (values.get("per_layer_config") or {}).values() if layer]
    widths = {ulysses_head_dim, values.get("global_head_dim"), *per_layer} - {None}
    return widths, ulysses_head_dim


def check_groups_not_created() -> None:
    """DeepSpeed creates its sequence-parallel groups once per process: a second sequence-parallel trainer in the same
    process would fail deep inside `train()`. Say so before anything runs."""
    check_no_sequence_parallel_groups_yet(sequence_parallel_groups_created())


@contextlib.contextmanager
def ulysses_enabled(module: torch.nn.Module | None):
    """DeepSpeed runs Ulysses only in training mode (accelerate sets disable_in_eval): a reference model in eval mode
    would attend within its own chunk. Its dropout is off (checked when sequence parallelism is set up)."""
    if module is None or module.training:
        yield
        return
    module.train()
    try:
        yield
    finally:
        module.eval()
