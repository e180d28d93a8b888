"""The config's refusals: values `DPOConfig` cannot take, and settings that need another (`DPOConfig.__post_init__`)."""

from __future__ import annotations

# ---- the config ----


def check_at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")


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


def check_dynamic_context_parallel_config(dynamic: bool, size: int, max_tokens_per_batch: int | None) -> None:
    """`dynamic_context_parallel` (packing/rank_shares.py): what the config must say."""
    if not dynamic:
        return
    if size < 2 or size & (size - 1):
        raise ValueError(
            f"dynamic_context_parallel=True needs context_parallel_size to be a power of two of at least 2 (the most "
            f"ranks a row may take; a row is split over 1, 2, 4 ... of them), got {size}. Set context_parallel_size "
            "to 2, 4, 8 ..., or dynamic_context_parallel=False."
        )
    if max_tokens_per_batch is None:
        raise ValueError(
            "dynamic_context_parallel=True needs max_tokens_per_batch: the tokens a group's ranks hold together at "
            f"each micro-step (each rank at most max_tokens_per_batch / {size}), from which it decides how many ranks "
            "each row needs. Set max_tokens_per_batch."
        )
