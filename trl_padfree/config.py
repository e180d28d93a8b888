"""`DPOConfig`: TRL's config plus the knobs of padding-free training."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import trl

from .modeling.backends import PACKING_AWARE
from .refusals.config import (
    check_at_least_one,
    check_context_parallel_config,
    check_dynamic_context_parallel_config,
    check_fp32_log_probs_value,
    check_prefix_sharing_config,
    check_prefix_sharing_value,
    check_sequence_parallel_not_under_fsdp,
    check_sequence_parallel_sizes_agree,
)
from .refusals.parallel import check_prefix_sharing_without_sequence_parallel


def changed_field(name: str, help_text: str, more_choices: tuple[str, ...] = ()):
    """A field of `trl.DPOConfig` (or of transformers' `TrainingArguments` under it) whose meaning trl-padfree changes:
    its default and metadata (choices) as there, with our help text and the values trl-padfree adds to its choices."""
    inherited = {trl_field.name: trl_field for trl_field in fields(trl.DPOConfig)}[name]
    metadata = {**inherited.metadata, "help": help_text}
    if more_choices:
        metadata["choices"] = [*inherited.metadata["choices"], *more_choices]
    return field(default=inherited.default, metadata=metadata)


@dataclass
class DPOConfig(trl.DPOConfig):
    r"""
    Configuration for [`trl_padfree.DPOTrainer`]: every field of [`trl.DPOConfig`], plus the ones below; three of TRL's
    fields mean more here (the last group).

    > Parameters that control padding-free training

        packed_attn_implementation (`str`, *optional*, defaults to `"auto"`):
            Attention used for packed rows, on the policy and the reference model. `"auto"` keeps
            `flash_attention_2`/`flash_attention_3` when the model already uses one, and otherwise switches to
            `"padfree_varlen"` (PyTorch's varlen flash attention on CUDA, exact per-sequence attention on CPU); for
            an architecture the check finds exact only on `"sdpa"` or `"eager"` (classes that keep their own attention
            code), it picks that one and logs why. `"keep"` keeps the model's own. `"sdpa"` and `"eager"` are exact
            too, but transformers gives them a dense block-diagonal causal mask over the whole row, built from
            `position_ids` (`T x T` for a row of `T` tokens), on CPU and CUDA alike: their attention costs the square
            of the row's length, masked blocks included (on CUDA, sdpa with a mask runs its memory-efficient or math
            kernel, never Flash). Per-segment sdpa is `"padfree_varlen"`'s fallback for layers its kernel refuses.

        max_tokens_per_batch (`int` or `None`, *optional*, defaults to `None`):
            Token-budget batching for training: fill each micro-batch with whole pairs (chosen and rejected together)
            up to this many tokens in the packed row, instead of `per_device_train_batch_size` pairs. The loss of an
            optimizer step is the mean over all of its pairs, across gradient accumulation and processes, as in
            padded training of the same pairs. Needs `padding_free=True`. A pair longer than the budget is an error;
            set `max_length` to at most half the budget to have TRL truncate every pair to fit.

        token_budget_window (`int`, *optional*, defaults to `1000`):
            With `max_tokens_per_batch`: pairs are shuffled (with `data_seed`, else `seed`), cut into windows of this
            many pairs, and each window packed best-fit decreasing. Larger windows fill rows better; smaller ones mix
            lengths more.

        prefix_sharing (`bool` or `"auto"`, *optional*, defaults to `False`):
            Compute each pair's prompt once: the pair is laid out as `[prompt | chosen | rejected]`, the rejected
            tokens attending to the prompt and themselves but not to the chosen ones, with positions continuing from
            the prompt. Losses, gradients and metrics equal unshared training. Needs `padding_free=True` and the
            `padfree_varlen` attention (`packed_attn_implementation="auto"` picks it); not with sequence parallelism
            or a Mixture-of-Experts auxiliary loss. `"auto"`: each batch is laid out shared when this model's cost
            model predicts a cheaper step (tokens and attention saved against the keys' and values' gather,
            docs/concepts/prefix-sharing.md), unshared otherwise; logged once per outcome. Vision-language batches always
            share under `"auto"` (each shared pair also encodes its images once).

        prefix_sharing_min_prompt_tokens (`int`, *optional*, defaults to `8`):
            With `prefix_sharing=True`: pairs whose prompt is shorter are laid out unshared, where the few saved
            tokens do not pay for the extra attention call; measured on CPU in docs/concepts/prefix-sharing.md. At least 2.
            Under `prefix_sharing="auto"` it does not apply to text batches: the cost model decides for the whole
            batch, and a batch laid out shared shares every pair whose prompt has at least 2 tokens. It does apply to
            vision-language batches, which `"auto"` always shares. Always unshared: pairs whose chosen and rejected
            sequences were truncated into the prompt by different amounts (`truncation_mode="keep_end"`).
            `padfree/shared_pairs` logs the fraction shared.

    > Parameters that control numerics

        fp32_log_probs (`bool` or `None`, *optional*, defaults to `None`):
            `None` (auto): `True` with `padding_free=True`, `False` (TRL's behaviour) with `padding_free=False`, so
            that the padded trainer is TRL's. An explicit `True` or `False` (Python, YAML, or `--fp32_log_probs
            true|false` on the command line) applies in either mode. When on: keep the per-token log-probs of TRL's
            fused LM head, and so their per-sequence sums and the DPO margin,
            in float32 under an engine that would cast them to bf16. TRL's head computes them in float32 (online
            log-sum-exp over its logits tiles), but FSDP2 with bf16 mixed precision casts a module's outputs to
            `MixedPrecisionPolicy.output_dtype`, which accelerate 1.15 sets to bf16 (1.16 leaves it unset, and there
            this option changes nothing): a sequence's log-prob near -500 is
            then a multiple of 2 and the loss a bf16 number (measured: 0.04 off the float32-sum loss after one step;
            docs/concepts/exactness.md, "bf16 engines"). With it, FSDP2 leaves the outputs in the dtype they are computed in
            (`output_dtype=None`, for the policy and the reference); costs nothing measurable. DeepSpeed, DDP and
            autocast do not cast outputs, so there it changes nothing. `False` is TRL's behaviour: the sums
            bf16 under FSDP2's bf16 mixed precision.

        cast_lm_head_to_fp32 (`bool`, *optional*, defaults to `False`):
            Project onto the vocabulary in float32, outside autocast (TRL's `add_fused_lm_head(...,
            cast_lm_head_to_fp32=True)`, its chunking kept), for the policy and the reference: the logits tiles are
            float32 instead of bf16. Measured under ZeRO-3 bf16 it moves the loss by about 6e-4, the size of bf16
            noise elsewhere in the model; it costs the LM head's GEMMs on the scored tokens in float32 (on a GPU
            without TF32 several times their bf16 time) and a float32 logits tile (4,096 x 32,768 x 4 bytes).

    > Parameters that control memory under DeepSpeed and FSDP2

        sequence_parallel_size (`int`, *optional*, defaults to `1`):
            Split each packed row over this many GPUs with DeepSpeed Ulysses (ALST), so one long preference pair can
            span several GPUs. Sets `parallelism_config` to accelerate's `ParallelismConfig(sp_backend="deepspeed",
            sp_size=N)`; needs `padding_free=True`, a DeepSpeed launch, attention heads divisible by N. Every rank of
            a group gets the same micro-batch; data parallelism runs across groups. An accelerate config can set it
            instead, with `parallelism_config_sp_size` (the shipped `zero3_sp2` config: `trl-padfree dpo --accelerate_config zero3_sp2`).

        context_parallel_size (`int`, *optional*, defaults to `1`):
            Split each packed row over this many processes with all-gather context parallelism
            (trl_padfree/parallel/context.py): each keeps a contiguous chunk of the row with all attention heads and
            all-gathers the row's keys and values in every attention layer. No head-count limit (Ulysses needs the
            heads to divide by its size), any engine (DDP, DeepSpeed ZeRO, FSDP2). Needs `padding_free=True`, the
            `padfree_varlen` attention, and a number of processes it divides; groups are consecutive ranks. With
            `sequence_parallel_size=S` too, S x N consecutive ranks share a row: Ulysses splits the heads S ways,
            context parallelism the rest. docs/guides/long-sequences.md.

        dynamic_context_parallel (`bool`, *optional*, defaults to `False`):
            With `context_parallel_size=C` (a power of two) and `max_tokens_per_batch`: split each micro-step's rows
            over as many of the group's ranks as their length needs (1, 2, 4 ... C) instead of every row over all C,
            no rank holding more than `max_tokens_per_batch / C` tokens. Short rows then run alone on one rank and
            gather nothing; the step trains the same pairs and the same loss. Logged per step:
            `padfree/ranks_per_row`, `padfree/rank_tokens_max`, `padfree/rank_tokens_mean`. Not with Ulysses
            (`sequence_parallel_size`) or vision-language rows. docs/guides/long-sequences.md.

        deal_images (`bool`, *optional*, defaults to `True`):
            With rows split over processes (`sequence_parallel_size` or `context_parallel_size` above 1) on a
            vision-language model: each process of a row runs the vision tower on its share of the row's images (a
            contiguous run of its sequences, balanced by image tokens) and the features are all-gathered,
            differentiably (trl_padfree/parallel/image_shares.py). `False`: every process runs it on all of the row's
            images. Both are exact; dealing divides the vision tower's time and activations by the processes of a
            row. Under DeepSpeed ZeRO-3 dealing is refused for a model that runs a module once per image or crop
            (PaddleOCR-VL, MiniCPM-V, LFM3-VL, HY-V4-VL): shares of different sizes would call it a different number
            of times, which ZeRO-3's gathers cannot follow. docs/guides/vision-language.md.

        ref_offload (`bool`, *optional*, defaults to `False`):
            Under DeepSpeed ZeRO-3, give the reference model its own inference config with its parameters offloaded
            to pinned CPU memory (`offload_param: {device: cpu, pin_memory: true}`), whatever the policy's offload
            settings: the GPUs then hold no reference weights, at the cost of fetching them over PCIe on every
            reference forward. The reference is loaded straight into CPU shards. With `precompute_ref_log_probs` it
            is released once the log-probs are computed. Under FSDP2 (`fsdp_version: 2`), shard the reference a
            unit per decoder layer under FSDP2's `CPUOffloadPolicy` (pinned), whatever the policy's
            `fsdp_offload_params` (docs/guides/multi-gpu.md). Raises without ZeRO-3 or FSDP2, or when there is no separate
            reference model (PEFT; or, under DeepSpeed, precomputed log-probs without a `ref_model`).

    > TRL's and transformers' fields whose meaning trl-padfree changes

        padding_free (`bool`, *optional*, defaults to `False`):
            TRL's field, which TRL 1.16 switches off ("temporarily unavailable"); trl-padfree honours it. `True`: every
            chosen and rejected sequence of a batch is packed into one row with no padding (`position_ids` restarting
            at 0 for each sequence, no attention mask), and losses, gradients and metrics equal those of padded TRL on
            the same pairs. `False`: TRL's padded batches. `trl_padfree.DPOConfig` keeps TRL's default, `False`, so a
            script that swaps it in trains padded until it sets `padding_free=True`; the `trl-padfree dpo` command
            defaults to `True` (set `padding_free: false` in its config, or `--padding_free false`, to train padded)
            and its first line says which mode trains.

        pad_to_multiple_of (`int` or `str`, *optional*, defaults to `"auto"`):
            TRL's field. With `padding_free=True` it pads the packed row, not each sequence: one padding segment at
            the end of the row brings its length to a multiple of this value. `"auto"` pads to a multiple of 128 on
            Neuron (AWS Trainium), which compiles once per input shape, and does not pad elsewhere, as in TRL.

        train_sampling_strategy (`str`, *optional*, defaults to `"random"`):
            transformers' field. With `padding_free=True`, `"batch_rebalance"` splits each optimizer step's pairs
            (the default sampler's, same seed) across processes and micro-steps by estimated FLOPs, so every
            data-parallel process's packed row costs about the same; each process's loss is weighted by its share of
            the step's pairs, so training equals padded TRL on the same global batches. Logs
            `padfree/balance_cost_max_over_mean`. Refused with loss types that couple a micro-batch's pairs (`aot`,
            `aot_unpaired`, `sft`), a MoE auxiliary loss, and with `max_tokens_per_batch` under split rows. With
            `prefix_sharing`, a step's pairs of one prompt stay on one process and micro-step (priced as their
            grouped row), so their prompt is computed once; without repeated prompts in a step nothing changes. With
            `padding_free=False` it is transformers' own `BatchRebalanceSampler`. See docs/concepts/balancing.md.

            `"group_by_prompt"` (trl-padfree's) puts a prompt's pairs in the same micro-batch: pairs whose prompts
            tokenize the same (vision-language pairs: the same prompt on the same images) are one group, and each epoch's groups are shuffled and packed into batches of
            `per_device_train_batch_size` pairs, every pair once per epoch, so training equals padded TRL fed the
            same batches. Pick a batch size the pairs per prompt divide (K completions paired all ways: K(K-1)/2
            pairs), or groups get cut across batches. With `padding_free=True` and `prefix_sharing`, each prompt is
            then computed once per micro-batch; otherwise it only orders the batches. Data with K scored
            completions per prompt becomes pairs with `trl_padfree.pair_scored_completions`. With
            `max_tokens_per_batch`, the budget's micro-batches are filled with whole groups instead, each sized as its
            grouped row under `prefix_sharing=True` (else the sum of its pairs' rows); a group over the budget is cut
            into pieces that fit.
    """

    # TRL's fields whose meaning changes here: TRL's default and choices, our help (what `trl-padfree dpo --help` shows)
    padding_free: bool = changed_field(
        "padding_free",
        "Pack each batch's chosen and rejected sequences into one row, no padding, with the losses, gradients and "
        "metrics of padded TRL (trl-padfree honours this TRL field, which TRL 1.16 switches off). false: TRL's padded "
        "batches. Defaults to true in `trl-padfree dpo`, to false (TRL's default) in trl_padfree.DPOConfig.",
    )
    pad_to_multiple_of: int | str | None = changed_field(
        "pad_to_multiple_of",
        "Pad to a multiple of this value: with padding_free=true the packed row (one padding segment at its end), "
        "else each sequence, as TRL. 'auto' pads to a multiple of 128 on Neuron (AWS Trainium), not elsewhere.",
    )
    train_sampling_strategy: str = changed_field(
        "train_sampling_strategy",
        "Sampler for training: 'random' (default), 'sequential', 'group_by_length', 'batch_rebalance' (with "
        "padding_free=true: each step's pairs split over processes and micro-steps so every packed row costs about "
        "the same, training equal to padded TRL on the same batches; docs/concepts/balancing.md), or "
        "'group_by_prompt' (a prompt's pairs in the same micro-batch; pick a batch size the pairs per prompt divide, "
        "or max_tokens_per_batch to fill micro-batches with whole groups; prefix sharing then computes each prompt "
        "once per micro-batch).",
        more_choices=("group_by_prompt",),
    )
    packed_attn_implementation: str = field(
        default="auto",
        metadata={
            "help": "Attention for packed rows: 'auto' (flash varlen if the model uses it, else 'padfree_varlen'), "
            f"'keep', or one of {', '.join(repr(name) for name in PACKING_AWARE)}."
        },
    )
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={
            "help": "Token-budget batching: fill each training micro-batch with whole pairs up to this many tokens "
            "(needs padding_free=True); per_device_train_batch_size is then not used for training."
        },
    )
    token_budget_window: int = field(
        default=1000,
        metadata={"help": "With max_tokens_per_batch: pairs per shuffled window packed best-fit decreasing."},
    )
    # A string field, so that the command line takes "auto" (HfArgumentParser reads `bool | str` as bool); `true` and
    # `false`, from a YAML file or the command line, become booleans in __post_init__
    prefix_sharing: str = field(
        default=False,
        metadata={
            "help": "Compute each pair's prompt once, as [prompt | chosen | rejected] with rejected tokens not seeing "
            "chosen ones (needs padding_free=True and the padfree_varlen attention): true, false, or 'auto' (each "
            "batch shared when the model's cost model predicts a gain)."
        },
    )
    prefix_sharing_min_prompt_tokens: int = field(
        default=8,
        metadata={
            "help": "With prefix_sharing=true: lay out pairs with shorter prompts unshared (at least 2). Under "
            "prefix_sharing='auto' it applies to vision-language batches only (text batches: the cost model decides)."
        },
    )
    ref_offload: bool = field(
        default=False,
        metadata={
            "help": "DeepSpeed ZeRO-3 or FSDP2: keep the reference model's parameters in pinned CPU memory (ZeRO-3: "
            "its own stage-3 config with offload_param cpu; FSDP2: CPUOffloadPolicy on the reference only), "
            "independent of the policy's offload settings."
        },
    )
    # `bool | None`: the command line takes `--fp32_log_probs true` or `false`; unset (None) is "auto"
    fp32_log_probs: bool | None = field(
        default=None,
        metadata={
            "help": "Keep per-token log-probs, their sums and the DPO margin in float32 under engines that cast "
            "outputs to bf16 (FSDP2's output_dtype), for the policy and the reference: true or false. Unset: true "
            "with padding_free=True, false (TRL's behaviour) with padding_free=False."
        },
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={"help": "Run the fused LM head's projection in float32 (float32 logits tiles), outside autocast."},
    )
    context_parallel_size: int = field(
        default=1,
        metadata={
            "help": "All-gather context parallelism: split each packed row over this many processes, every "
            "attention head on every process (needs padding_free=True and the padfree_varlen attention)."
        },
    )
    dynamic_context_parallel: bool = field(
        default=False,
        metadata={
            "help": "With context_parallel_size and max_tokens_per_batch: split each row over as many of the group's "
            "ranks as its length needs (1, 2, 4 ... context_parallel_size), not always all of them."
        },
    )
    deal_images: bool = field(
        default=True,
        metadata={
            "help": "With rows split over processes: each runs the vision tower on its share of the row's images, "
            "the features all-gathered (False: every process runs it on all of them)."
        },
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={
            "help": "DeepSpeed Ulysses sequence parallelism: split each packed row over this many GPUs (needs "
            "padding_free=True and a DeepSpeed launch)."
        },
    )

    def __post_init__(self):
        self.prefix_sharing = prefix_sharing_setting(self.prefix_sharing)
        self.fp32_log_probs = fp32_log_probs_setting(self.fp32_log_probs)
        check_at_least_one("sequence_parallel_size", self.sequence_parallel_size)
        check_context_parallel_config(self.context_parallel_size, self.padding_free)
        check_dynamic_context_parallel_config(
            self.dynamic_context_parallel, self.context_parallel_size, self.max_tokens_per_batch
        )
        if self.max_tokens_per_batch is not None:
            check_at_least_one("max_tokens_per_batch", self.max_tokens_per_batch)
        check_prefix_sharing_config(self.prefix_sharing, self.padding_free, self.prefix_sharing_min_prompt_tokens)
        check_at_least_one("token_budget_window", self.token_budget_window)
        launched_size = sequence_parallel_size_from_accelerate_launch()
        check_sequence_parallel_sizes_agree(self.sequence_parallel_size, launched_size)
        if launched_size > 1:
            self.sequence_parallel_size = launched_size
        check_prefix_sharing_without_sequence_parallel(self.prefix_sharing, self.sequence_parallel_size > 1)
        if self.sequence_parallel_size > 1 and self.parallelism_config is None:
            from accelerate.parallelism_config import ParallelismConfig
            from accelerate.utils import DeepSpeedSequenceParallelConfig

            # accelerate accepts only transformers' built-in kernels here; the trainer hands DeepSpeed the model's
            # packing-aware attention instead (features/row_split.py)
            handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
            self.parallelism_config = ParallelismConfig(
                sp_backend="deepspeed", sp_size=self.sequence_parallel_size, sp_handler=handler
            )
        super().__post_init__()
        # Imported here: placement/ imports TRL's trainer, which the command line's parser need not wait for
        from .placement.fsdp2 import planned_fsdp_version

        check_sequence_parallel_not_under_fsdp(self.sequence_parallel_size, planned_fsdp_version(self))


def prefix_sharing_setting(value) -> bool | str:
    """`prefix_sharing` as set in Python, YAML or on the command line: True, False or "auto"."""
    if isinstance(value, bool):
        return value
    normalized = str(value).strip().lower()
    settings = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False, "auto": "auto"}
    check_prefix_sharing_value(value, normalized in settings)
    return settings[normalized]


def fp32_log_probs_setting(value) -> bool | None:
    """`fp32_log_probs` as set in Python, YAML or on the command line: True, False, or None ("auto")."""
    if value is None or isinstance(value, bool):
        return value
    normalized = str(value).strip().lower()
    settings = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False, "auto": None}
    check_fp32_log_probs_value(value, normalized in settings)
    return settings[normalized]


def sequence_parallel_size_from_accelerate_launch() -> int:
    # `accelerate launch` passes a config file's `parallelism_config` section on as environment variables
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1
    if os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed") != "deepspeed":
        return 1
    return int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1"))
