"""`PaddingFree`: padding-free training as one feature of the trainer, in the phases `ReferencePlacement` has:

    before TRL's __init__   refuse what cannot pack before anything is built (a collator that does not pack, Liger)
    around it               hide `padding_free` from TRL, which would switch it off
    enable                  resolve the plan once (the packing collator, each model's attention checked on its
                            architecture, prefix sharing, the row multiple) and give every model the packed forward,
                            with what it reads of the model decided (`packed_forward.ForwardPlan`): after TRL's
                            __init__, or earlier at TRL's reference precompute, which runs inside it
    after it                keep accelerate's dispatcher from slicing packed batches; report prefix sharing

Then, per batch: the padded-layout inputs TRL's loss reads (`padded_inputs`) and the packing metrics (`log_metrics`);
per training log, the real tokens per second (`log_tokens_per_second`); and the model card's record of it all
(`model_card_section`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch
from accelerate.utils import is_peft_model
from transformers import AutoConfig, TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from ..integrations.transformers import attn_implementation, modeling_modules_imported, set_language_model_attention
from ..integrations.trl import padding_free_hidden
from ..modeling.check.packability import verify_packable
from ..modeling.mixers import mixers_run_per_segment
from ..modeling.packed_forward import PACKED_BATCH_KWARG, PackedBatch, add_packed_forward
from ..modeling.vision import image_token_id, per_image_loop
from ..packing.collator import PaddingFreePreferenceCollator
from ..packing.layout import pad_length_to_multiple, row_multiple
from ..packing.prefix_sharing import PrefixSharing, SharingCost, log_sharing_summary
from ..packing.vision import PaddingFreeVisionPreferenceCollator
from ..placement.fsdp2 import lm_head_tied
from ..refusals.batches import check_batches_not_dispatched, check_packed_batch_expected, check_packing_collator
from ..refusals.models import (
    check_attention_switched,
    check_moe_aux_loss_without_row_padding,
    check_no_liger_kernel,
    check_not_prompt_learning,
    check_prefix_sharing_without_moe_aux_loss,
)
from ..refusals.parallel import check_zero3_mixer_calls, check_zero3_per_image_loop
from ..settings import Settings


@dataclass(frozen=True)
class PackingPlan:
    """What padding-free training resolved for a trainer, once."""

    attention: tuple[tuple[str, str], ...]  # (model class, backend) of the policy, then the reference
    prefix_sharing: PrefixSharing
    # What TRL's padded collator pads each sequence to: the padded side of the padding-saved metrics
    padded_pad_to_multiple_of: int | None


class PaddingFree:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.requested = settings.padding_free
        self.plan: PackingPlan | None = None
        self.throughput = TrainingThroughput()

    @classmethod
    def before_init(cls, settings: Settings, args, model, data_collator) -> PaddingFree:
        """What `args` asks for, refusing before anything is built what cannot pack; under ZeRO-3, the modules of
        `model`'s parts imported before `zero.Init` builds them (`modeling_modules_imported`: else the architecture
        check's twin, built after, may not run)."""
        feature = cls(settings)
        if feature.requested:
            if is_deepspeed_zero3_enabled():
                modeling_modules_imported(_model_config(model, args))
            if data_collator is not None:
                packing_collators = (PaddingFreePreferenceCollator, PaddingFreeVisionPreferenceCollator)
                packs = isinstance(data_collator, packing_collators) and data_collator.padding_free
                check_packing_collator(type(data_collator).__name__, packs)
            check_no_liger_kernel(args.use_liger_kernel)
        return feature

    def around_init(self, args):
        """Around TRL's `__init__`: `padding_free` hidden from it (TRL 1.16 switches it off, with a warning)."""
        return padding_free_hidden(args) if self.requested else contextlib.nullcontext()

    @property
    def enabled(self) -> bool:
        return self.plan is not None

    def enable(self, trainer) -> None:
        """The plan, resolved once: the packing collator, each model's attention, the packed forward on every model."""
        if not self.requested or self.enabled:
            return
        settings = self.settings
        models = _models(trainer)
        images = trainer.is_vision_dataset
        collator = _packing_collator(trainer.data_collator, settings, models[0].config if images else None)
        _refuse_what_cannot_pack(trainer, settings, collator, models[0])
        if settings.prefix_sharing is PrefixSharing.AUTO and not images:  # weighed per batch by its cost model
            cost = SharingCost.of_model(models[0], trainer.accelerator.device.type)
            collator = dataclasses.replace(collator, prefix_sharing_cost=cost)
        trainer.data_collator = collator
        # Prefix sharing and context parallelism run in `padfree_varlen`: 'auto' picks it for them
        needs_padfree_varlen = bool(settings.prefix_sharing) or settings.context_parallel_size > 1
        attention = []
        for model in models:
            backend = verify_packable(
                model, settings.packed_attn_implementation, settings.prefix_sharing.value, needs_padfree_varlen, images
            )
            if backend != attn_implementation(model):
                set_language_model_attention(model, backend)
                check_attention_switched(type(model).__name__, backend, attn_implementation(model))
            add_packed_forward(model)
            attention.append((type(model).__name__, backend))
        self.plan = PackingPlan(tuple(attention), settings.prefix_sharing, collator.pad_to_multiple_of)

    def after_init(self, trainer) -> None:
        """After TRL's `__init__`: enabled; each process builds its own packed rows (accelerate's dispatcher, its
        default for streamed datasets, would slice them); how much of the training set prefix sharing shares."""
        if not self.requested:
            return
        self.enable(trainer)
        trainer.add_callback(self.throughput)
        dataloader_config = trainer.accelerator.dataloader_config
        check_batches_not_dispatched(dataloader_config.dispatch_batches, dataloader_config.split_batches)
        dataloader_config.dispatch_batches = False
        if self.settings.prefix_sharing and not trainer.is_vision_dataset:  # (a vision set is tokenized per batch)
            args = trainer.args
            minimum = self.settings.grouped_min_prompt_tokens
            log_sharing_summary(trainer.train_dataset, args.max_length, args.truncation_mode, minimum)

    def pad_rows_to(self, trainer, ranks_per_row: int) -> None:
        """Rows a multiple of the ranks that share each one (sequence and context parallelism)."""
        collator = trainer.data_collator
        multiple = row_multiple(collator.pad_to_multiple_of, ranks_per_row)
        trainer.data_collator = dataclasses.replace(collator, pad_to_multiple_of=multiple)

    def padded_inputs(self, trainer, inputs: dict) -> dict:
        """The padded-layout inputs TRL's loss code reads, carrying the packed row the forward really runs on."""
        check_packed_batch_expected(self.enabled)
        packed_batch = PackedBatch.from_collated(inputs)
        # A processor pads with its tokenizer, as TRL's collator does
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        padded = packed_batch.padded_inputs(tokenizer.pad_token_id)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in inputs:
                padded[key] = inputs[key]
        padded[PACKED_BATCH_KWARG] = packed_batch
        return padded

    def log_metrics(self, trainer, packed_batch: PackedBatch, budget: int | None) -> None:
        """What packing saved on this micro-batch, next to TRL's metrics (so every `report_to` sees them).

        `padfree/real_tokens` and `padfree/padded_tokens` are summed over processes: the tokens of the batch's
        sequences, and the tokens TRL's padded collator would have made of them (2 x pairs x longest). With prefix
        sharing, `padfree/shared_tokens` (summed) are the prompt tokens computed once instead of twice, and
        `padfree/shared_pairs` the fraction of pairs laid out shared. With token-budget batching (`budget`),
        `padfree/pairs_per_micro_batch` and `padfree/budget_fill` (row tokens / budget) are averaged over processes.
        On vision-language batches, `padfree/images_encoded` (summed) are the images the row hands the vision tower,
        and `padfree/images_padded` those TRL's padded batch hands it (each pair's twice). A training row's tokens
        (summed) count towards `padfree/tokens_per_second` (`log_tokens_per_second`).
        """
        totals, processes = _summed_over_processes(trainer.accelerator, _counts(packed_batch, self.plan), packed_batch)
        if trainer.model.training:
            self.throughput.count(totals["row_tokens"])
        metrics = trainer.logged_metrics("train" if trainer.model.training else "eval")
        metrics["padfree/real_tokens"].append(totals["real_tokens"])
        metrics["padfree/padded_tokens"].append(totals["padded_tokens"])
        metrics["padfree/padding_removed"].append(1.0 - totals["real_tokens"] / totals["padded_tokens"])
        metrics["padfree/row_length"].append(totals["row_length"] / processes)
        if packed_batch.shared_prefix_lens is not None:  # a prefix-sharing collator made the row
            metrics["padfree/shared_tokens"].append(totals["real_tokens"] - totals["row_tokens"])
            metrics["padfree/shared_pairs"].append(totals["shared_pairs"] / totals["pairs"])
        if packed_batch.images_per_sequence is not None:  # a vision-language batch
            metrics["padfree/images_encoded"].append(totals["images_encoded"])
            metrics["padfree/images_padded"].append(totals["images_padded"])
        if budget is not None and trainer.model.training:
            metrics["padfree/pairs_per_micro_batch"].append(totals["pairs"] / processes)
            metrics["padfree/budget_fill"].append(totals["row_tokens"] / processes / budget)

    def log_tokens_per_second(self, trainer) -> None:
        """At a training log: `padfree/tokens_per_second`, the real tokens of the packed rows trained since the last
        log (the rows' tokens but their padding, summed over processes, a row split over ranks counted once) over the
        host-clock seconds of those training steps (`TrainingThroughput`)."""
        rate = self.throughput.rate()
        if rate is not None:
            trainer.logged_metrics("train")["padfree/tokens_per_second"].append(rate)

    def model_card_section(self, trainer) -> str:
        """The model card's record of padding-free training: its settings and the padding it removed."""
        settings = self.settings
        attention = "none (padded batches)"
        if self.plan is not None:
            roles = ("policy", "reference")  # no reference under PEFT: the policy alone
            attention = ", ".join(
                f"{backend} ({role}, {name})"
                for role, (name, backend) in zip(roles, self.plan.attention, strict=False)
            )
        settings = {
            "padding_free": self.requested,
            "packed attention implementation": attention,
            "prefix_sharing": settings.prefix_sharing.value,
            "max_tokens_per_batch": settings.max_tokens_per_batch,
            "sequence_parallel_size": settings.sequence_parallel_size,
            "context_parallel_size": settings.context_parallel_size,
            "ref_offload": settings.ref_offload,
        }
        removed = padding_removed(trainer.state.log_history)
        measured = "not measured (no training step logged)"
        if removed is not None:
            measured = f"{removed:.1%} of the tokens TRL's padded batches would have held (training logs)"
        rows = [f"| `{name}` | `{value}` |" for name, value in settings.items()]
        rows.append(f"| padding removed | {measured} |")
        return "\n".join(["## Padding-free training (trl-padfree)", "", "| setting | value |", "|---|---|", *rows, ""])


class TrainingThroughput(TrainerCallback):
    """The host clock over training steps, for `padfree/tokens_per_second`: a step runs from the fetch of its
    micro-batches (`step_starting`, from the trainer's `get_batch_samples`) to Trainer's `on_step_end`, so the
    evaluations and checkpoint saves between steps are not counted. At a log, the time since the logged step's end
    (Trainer's read of the loss, which waits for the device) is, so steps the device has not finished by their end
    are counted in full. No device sync of its own: the token counts are the collator's host integers."""

    def __init__(self):
        self.tokens = 0  # since the last log, summed over processes
        self.seconds = 0.0  # of the steps since the last log
        self.step_started: float | None = None
        self.step_ended: float | None = None

    def step_starting(self) -> None:
        self.step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.step_started is not None:
            self.step_ended = time.perf_counter()
            self.seconds += self.step_ended - self.step_started
            self.step_started = None

    def count(self, tokens: float) -> None:
        self.tokens += tokens

    def rate(self) -> float | None:
        """Tokens per second since the last log, then reset; None without trained tokens since."""
        if not self.tokens:
            return None
        seconds = self.seconds + (time.perf_counter() - self.step_ended if self.step_ended is not None else 0.0)
        tokens, self.tokens, self.seconds, self.step_ended = self.tokens, 0, 0.0, None
        return tokens / seconds if seconds > 0 else None


def padding_removed(log_history: list[dict]) -> float | None:
    """The fraction of padded tokens the packed training rows avoided: 1 - real / padded tokens, summed over the
    training logs of `padfree/real_tokens` and `padfree/padded_tokens` (each a log's mean over its micro-batches);
    None before the first."""
    logged = [entry for entry in log_history if "padfree/padded_tokens" in entry]
    if not logged:
        return None
    return 1.0 - sum(entry["padfree/real_tokens"] for entry in logged) / sum(
        entry["padfree/padded_tokens"] for entry in logged
    )


def _packing_collator(collator, settings: Settings, vision_config=None):
    """The padding-free twin of TRL's collator (or the one passed in), with the settings' prefix sharing; for a
    vision dataset (`vision_config`: the policy's config), the twin of TRL's vision collator, placing images on the
    model's image token."""
    if vision_config is not None:
        if not isinstance(collator, PaddingFreeVisionPreferenceCollator):
            collator = PaddingFreeVisionPreferenceCollator.from_padded(collator)
        if collator.image_token_id is None:
            collator = dataclasses.replace(collator, image_token_id=image_token_id(vision_config))
    elif not isinstance(collator, PaddingFreePreferenceCollator):
        collator = PaddingFreePreferenceCollator.from_padded(collator)
    if settings.prefix_sharing:  # set in the config, or on a collator passed in
        collator = dataclasses.replace(
            collator,
            prefix_sharing=settings.prefix_sharing.value,
            prefix_sharing_min_prompt_tokens=settings.prefix_sharing_min_prompt_tokens,
        )
    return collator


def _refuse_what_cannot_pack(trainer, settings: Settings, collator, policy: torch.nn.Module) -> None:
    """Refuse, before any forward (TRL's reference precompute runs one inside its __init__), what the trainer's
    set-up cannot pack: MoE auxiliary loss without rows padded alike, or with prefix sharing; under ZeRO-3, a model
    that runs a module once per image or crop (modeling/vision.py) where the processes can run different numbers of
    images (holding different rows under data parallelism, or sharing a row whose images they deal under sequence and
    context parallelism with `deal_images`), and a model whose stateful mixers run once per sequence where the
    processes' batches hold different numbers of pairs (token budgets, balanced batches). The trainer and the policy
    are read here, once."""
    images = trainer.is_vision_dataset
    aux_loss = trainer.aux_loss_enabled
    pad_to_multiple_of = collator.pad_to_multiple_of
    accelerator = trainer.accelerator
    plugin = accelerator.state.deepspeed_plugin
    zero_stage = None if plugin is None else plugin.zero_stage
    model_name = type(policy).__name__
    loop = per_image_loop(policy) if images else None
    mixers_per_segment = mixers_run_per_segment(policy, accelerator.device)
    tied_lm_head = lm_head_tied(policy) if images else None
    check_moe_aux_loss_without_row_padding(aux_loss, pad_to_multiple_of)
    check_prefix_sharing_without_moe_aux_loss(settings.prefix_sharing.value, aux_loss)
    if images:
        ranks_per_row = settings.ranks_per_row
        check_zero3_per_image_loop(
            model_name,
            loop,
            zero_stage=zero_stage,
            row_groups=accelerator.num_processes // ranks_per_row,
            dealt_over=ranks_per_row if settings.deal_images else 1,
            tied_lm_head=tied_lm_head,
        )
    check_zero3_mixer_calls(
        mixers_per_segment, zero_stage=zero_stage, processes=accelerator.num_processes, uneven=settings.uneven_batches
    )


def _models(trainer) -> list[torch.nn.Module]:
    """The policy (its base model under PEFT) and the reference model, unwrapped: `torch.compile`'s wrapper too
    (accelerate compiles the reference at TRL's `__init__` under `torch_compile=True`), so each model's own class is
    checked and its own forward packed, which the compiled wrapper calls."""
    policy = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if is_peft_model(policy):
        check_not_prompt_learning(policy.peft_config[policy.active_adapter].is_prompt_learning)
        policy = policy.get_base_model()
    models = [policy]
    if trainer.ref_model is not None:
        models.append(trainer.accelerator.unwrap_model(trainer.ref_model, keep_torch_compile=False))
    return models


def _counts(packed_batch: PackedBatch, plan: PackingPlan) -> dict[str, float]:
    # From the host integers: none of these waits for the device
    host = packed_batch.host
    sequences = len(host.seq_lens)
    padded_width = pad_length_to_multiple(packed_batch.width, plan.padded_pad_to_multiple_of)
    return {
        "real_tokens": sum(host.seq_lens),
        "padded_tokens": sequences * padded_width,
        "row_length": packed_batch.row_length,
        "pairs": sequences // 2,
        "row_tokens": packed_batch.real_row_tokens,
        "shared_pairs": host.shared_pairs,
        "images_encoded": packed_batch.images_encoded,
        "images_padded": 0
        if packed_batch.images_per_sequence is None
        else int(packed_batch.images_per_sequence.sum()),
    }


def _summed_over_processes(accelerator, counts: dict[str, float], packed_batch: PackedBatch):
    """`counts` summed over processes, by name, and how many rows they came from. Every rank of a split row holds the
    same row: counted once, by the row's first rank."""
    names = sorted(counts)
    counted = packed_batch.split is None or packed_batch.split.row.rank == 0
    values = [counts[name] * counted for name in names] + [float(counted)]
    gathered = accelerator.gather(torch.tensor(values, dtype=torch.float64, device=accelerator.device))
    totals = gathered.view(-1, len(names) + 1).sum(0).tolist()
    return dict(zip(names, totals[:-1], strict=True)), round(totals[-1])


def _model_config(model, args):
    """The config of `model`: a model's own, or for a model TRL will load by name, the one it will load."""
    if not isinstance(model, str):
        return model.config
    init_kwargs = args.model_init_kwargs or {}
    trust_remote_code = init_kwargs.get("trust_remote_code", args.trust_remote_code)  # as TRL's own loading reads it
    return AutoConfig.from_pretrained(model, revision=init_kwargs.get("revision"), trust_remote_code=trust_remote_code)
