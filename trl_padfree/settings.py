"""`Settings`: what a trainer's config asks of trl-padfree, resolved once at `DPOTrainer.__init__`.

Every option trl-padfree adds to `DPOConfig` (`config.py`), its value after defaults and "auto", the batching TRL's
`train_sampling_strategy` asks for, and the parallel sizes, in one frozen object. The features read it; nothing else
reads the config's options. A plain `trl.DPOConfig`, which has none of them, resolves to their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import trl

from .config import (
    DPOConfig,
    fp32_log_probs_setting,
    prefix_sharing_setting,
    sequence_parallel_size_from_accelerate_launch,
)
from .packing.prefix_sharing import DEFAULT_MIN_PROMPT_TOKENS, PrefixSharing
from .placement.fsdp2 import planned_fsdp_version

GROUP_BY_PROMPT = "group_by_prompt"  # the `train_sampling_strategy` of prompt groups (packing/prompt_groups.py)
REBALANCE = "batch_rebalance"  # transformers' `train_sampling_strategy` that balances padding-free batches


@dataclass(frozen=True)
class Settings:
    """What the config asks for, resolved (`Settings.resolve`)."""

    padding_free: bool = False
    packed_attn_implementation: str = "auto"
    max_tokens_per_batch: int | None = None
    token_budget_window: int = 1000
    prefix_sharing: PrefixSharing = PrefixSharing.OFF
    prefix_sharing_min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS
    ref_offload: bool = False
    fp32_log_probs: bool = False  # resolved: unset means on exactly when the trainer packs
    cast_lm_head_to_fp32: bool = False
    context_parallel_size: int = 1
    dynamic_context_parallel: bool = (
        False  # rows over 1, 2, 4 ... context_parallel_size ranks (packing/rank_shares.py)
    )
    deal_images: bool = True
    sequence_parallel_size: int = 1  # DeepSpeed Ulysses ranks per row, as accelerate will set them up
    fsdp_version: int | None = None  # the FSDP version the run asks for; None without FSDP
    train_sampling_strategy: str = "random"
    trust_remote_code: bool = False  # TRL's, for the processor it loads
    model_revision: str | None = None  # `model_init_kwargs`' revision, for a model TRL loads by name

    @classmethod
    def resolve(cls, args, data_collator=None) -> Settings:
        """`args` (a `trl_padfree.DPOConfig`, a plain `trl.DPOConfig` or None) resolved; prefix sharing set on a
        packing collator passed in counts when the config leaves it off."""
        if args is None:
            return cls()
        own = {name: getattr(args, name, default) for name, default in OWN_DEFAULTS.items()}
        prefix_sharing = PrefixSharing.of(prefix_sharing_setting(own.pop("prefix_sharing")))
        min_prompt_tokens = own.pop("prefix_sharing_min_prompt_tokens")
        if not prefix_sharing and getattr(data_collator, "prefix_sharing", False):
            prefix_sharing = PrefixSharing.of(data_collator.prefix_sharing)
            min_prompt_tokens = data_collator.prefix_sharing_min_prompt_tokens
        fp32_log_probs = fp32_log_probs_setting(own.pop("fp32_log_probs"))
        own.pop("sequence_parallel_size")  # accelerate's parallelism config is what sets Ulysses up
        return cls(
            padding_free=bool(args.padding_free),
            prefix_sharing=prefix_sharing,
            prefix_sharing_min_prompt_tokens=min_prompt_tokens,
            fp32_log_probs=bool(args.padding_free) if fp32_log_probs is None else fp32_log_probs,
            sequence_parallel_size=_ulysses_size(args.parallelism_config),
            fsdp_version=planned_fsdp_version(args),
            train_sampling_strategy=str(args.train_sampling_strategy),
            trust_remote_code=args.trust_remote_code,
            model_revision=(args.model_init_kwargs or {}).get("revision"),
            **own,
        )

    @property
    def ranks_per_row(self) -> int:
        """The ranks that share each packed row: Ulysses' times context parallelism's."""
        return self.sequence_parallel_size * self.context_parallel_size

    @property
    def group_by_prompt(self) -> bool:
        return self.train_sampling_strategy == GROUP_BY_PROMPT

    @property
    def batch_rebalance(self) -> bool:
        return self.train_sampling_strategy == REBALANCE

    @property
    def sized_min_prompt_tokens(self) -> int | None:
        """`PrefixSharing.sized_min_prompt_tokens` of these settings."""
        return self.prefix_sharing.sized_min_prompt_tokens(self.prefix_sharing_min_prompt_tokens)

    @property
    def grouped_min_prompt_tokens(self) -> int | None:
        """`PrefixSharing.grouped_min_prompt_tokens` of these settings."""
        return self.prefix_sharing.grouped_min_prompt_tokens(self.prefix_sharing_min_prompt_tokens)

    @property
    def uneven_batches(self) -> str:
        """The setting that gives processes batches of different pair counts, said as set; "" when none does."""
        if self.max_tokens_per_batch is not None:
            return "max_tokens_per_batch"
        if self.batch_rebalance:
            return f"train_sampling_strategy={REBALANCE!r}"
        return ""


# The options trl-padfree adds to TRL's config, with their defaults: what a plain `trl.DPOConfig` resolves to
OWN_DEFAULTS = {
    each.name: each.default for each in fields(DPOConfig) if each.name not in {f.name for f in fields(trl.DPOConfig)}
}


def _ulysses_size(parallelism_config) -> int:
    """The Ulysses ranks per row accelerate sets up: its parallelism config's (the config's, or else the one
    `accelerate launch` passes in its environment, which accelerate reads then)."""
    if parallelism_config is None:
        return sequence_parallel_size_from_accelerate_launch()
    return parallelism_config.sp_size if parallelism_config.sp_backend == "deepspeed" else 1
