"""Train DPO a few steps on a saved tiny model and write what happened as JSON, for multi-process tests.

Run it with plain `python` for a single-process baseline, or under `accelerate launch` (DeepSpeed over gloo on CPU
with `DS_ACCELERATOR=cpu`) for the distributed run; rank 0 writes `--output`:

    {"<run>": {"losses": [...], "metrics": [{...}, ...], "world_size": 2, "zero_stage": 3,
               "reference": {"offloaded": true, "kept": true}, "policy_sharded": true,
               "peak_gpu_memory_bytes": null, "sequence_parallel_size": 1, "sequences_split_across_ranks": 0},
     ...}

The data is the shipped preference set, so both runs see the same pairs; with the same seed the Trainer's sampler
gives a process its slice of the same global batches the single process sees whole. With `--vision` the model folder
holds a saved vision-language model and, where it can be saved, its processor (else tests/support/tiny_vision/ builds it), and
the data is `tiny_vision.vision_preference_rows`, pairs with noise images.

With `--prompt-groups K` the data is prompt groups: each of the first `--num-pairs` shipped prompts with K of the
shipped completions, paired all ways by `pair_scored_completions` (K = 4: 6 pairs per prompt; `--group-prompts`
names the shipped prompts instead, e.g. long ones). This package's trainer batches them with
`train_sampling_strategy="group_by_prompt"`; TRL's (the 'trl' option), which cannot, is fed the same grouped batches,
`--joined-processes` of them together per micro-batch: a one-process baseline of that many processes. The report's "prompt_groups" says which pairs and prompts each process's micro-batches held.

`--model` is a saved model folder, or a folder of them: a run named `NAME:<options>` trains `<model>/NAME`, so one
launch can train several architectures one after the other (the report keys are the run names as given).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import sys
import time
import warnings
from array import array
from itertools import pairwise
from pathlib import Path

import torch
import trl
from transformers import TrainerCallback

import trl_padfree
from trl_padfree import DPOConfig, DPOTrainer, pair_scored_completions
from trl_padfree.cli import exit_without_finalizing
from trl_padfree.data import load_demo_dataset, load_demo_tokenizer
from trl_padfree.features.pair_weighted_steps import batch_sampler_dataloader
from trl_padfree.modeling.mixers import SEGMENTS_KWARG, MixerSegments, stateful_mixers
from trl_padfree.packing.balance import bin_costs, imbalance
from trl_padfree.packing.prompt_groups import PromptGroupBatchSampler, prompt_group_ids
from trl_padfree.packing.units import PairUnits
from trl_padfree.parallel.ulysses import sequence_parallel_size
from trl_padfree.placement.deepspeed import zero3_init_config, zero3_offloaded

# TRL 1.16 still calls transformers 5's deprecated gradient checkpointing names
warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6", category=FutureWarning)


# A run is named by its options joined with "+", e.g. "padding_free+ref_offload"
RUN_OPTIONS = (
    "trl",
    "padded",
    "padding_free",
    "ref_offload",
    "explicit_ref",
    "precompute",
    "bf16",
    "checkpointing",
    "sync",
    "sp",
    "lora",
    "eval",
    "prefix_sharing",
    "aux",
    "no_aux",
    "bf16_weights",
    "cp",
    "bf16_sums",
    "fp32_sums",
    "fp32_head",
    "balanced",
    "sgd",
    "whole_images",
    "dynamic",
)
# The 'aux' option's router_aux_loss_coef: large enough that the load-balancing term moves the loss visibly
AUX_LOSS_COEF = 0.05


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a saved model folder")
    parser.add_argument("--output", required=True)
    parser.add_argument(
        "--runs",
        default="padding_free",
        help=f"comma-separated runs, one after the other in the same processes; each joins options of {RUN_OPTIONS} "
        "with '+', optionally after 'NAME:' to train the model <model>/NAME ('trl': TRL's own trainer, padded; "
        "'padded': this package's trainer with padding_free=False, TRL's with its fused LM head's lookups fixed; "
        "'explicit_ref': pass a `ref_model`; 'sync': sync_ref_model every step, half way; 'sp': "
        f"sequence_parallel_size=2; 'aux': router_aux_loss_coef={AUX_LOSS_COEF}; 'no_aux': router_aux_loss_coef=0; 'bf16_weights': load in bfloat16; 'bf16_sums': fp32_log_probs=False, TRL's own precision; 'fp32_sums': fp32_log_probs=True (unset, it is on only with padding_free); 'fp32_head': "
        "cast_lm_head_to_fp32=True)",
    )
    parser.add_argument("--batch-size", type=int, default=2, help="pairs per process per micro-batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sp-size", type=int, default=2, help="sequence_parallel_size of the 'sp' option")
    parser.add_argument("--cp-size", type=int, default=2, help="context_parallel_size of the 'cp' option")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--max-tokens-per-batch", type=int, help="token-budget batching")
    parser.add_argument("--pairs", help="comma-separated indices: train on these pairs of the data only")
    parser.add_argument(
        "--save-grads",
        help="save the first optimizer step's gradients (unclipped, process 0) to this file ('{run}' in it: one file "
        "per run)",
    )
    parser.add_argument("--max-length", type=int, default=192)
    parser.add_argument(
        "--model-tokenizer",
        action="store_true",
        help="tokenize with the model folder's own tokenizer (a real checkpoint) instead of the shipped one",
    )
    parser.add_argument("--num-pairs", type=int, default=32, help="keep it equal across the runs compared")
    parser.add_argument(
        "--vision",
        action="store_true",
        help="the model folder holds a vision-language model and its processor: train on tests/support/tiny_vision/'s "
        "image pairs (the model type read from the folder's config)",
    )
    parser.add_argument(
        "--images-per-row", default="1", help="with --vision: comma-separated images per example, cycled over the rows"
    )
    parser.add_argument(
        "--prompt-groups",
        type=int,
        metavar="K",
        help="train on prompt groups: each of --num-pairs shipped prompts with K shipped completions, paired all ways "
        "(K(K-1)/2 pairs per prompt), batched by train_sampling_strategy='group_by_prompt' (TRL's trainer: fed the "
        "same batches)",
    )
    parser.add_argument(
        "--group-prompts",
        help="with --prompt-groups: comma-separated indices of the shipped pairs whose prompts (each with the K "
        "completions it would get as prompt i) make the groups, instead of the first --num-pairs",
    )
    parser.add_argument(
        "--joined-processes",
        type=int,
        default=1,
        metavar="N",
        help="with --prompt-groups, for TRL's trainer ('trl' runs only): stand in for N data-parallel processes, each "
        "micro-batch the N grouped batches of --batch-size pairs they run in one step",
    )
    parser.add_argument(
        "--given-batches",
        help="for TRL's trainer ('trl' runs): a JSON file of index lists, the pairs of each optimizer step in order",
    )
    parser.add_argument(
        "--count-collectives",
        action="store_true",
        help="report each step's torch.distributed calls and split-row host reads (step_collectives.py)",
    )
    parser.add_argument(
        "--watchdog",
        type=float,
        help="seconds: if a run takes longer, print every thread's stack and exit 1, so that processes stuck in "
        "mismatched collectives fail with their tracebacks instead of at the launcher's timeout",
    )
    return parser.parse_args(argv)


def split_run(run: str) -> tuple[str | None, str]:
    """`"qwen3_moe:padding_free+aux"` -> `("qwen3_moe", "padding_free+aux")`; no prefix: `(None, run)`."""
    name, _, options = run.rpartition(":")
    return name or None, options


def model_path(run: str, options: argparse.Namespace) -> str:
    name, _ = split_run(run)
    return options.model if name is None else str(Path(options.model) / name)


def run_options(run: str) -> set[str]:
    options = set(split_run(run)[1].split("+"))
    if unknown := options - set(RUN_OPTIONS):
        raise ValueError(f"Unknown run options {sorted(unknown)} in {run!r}; choose from {RUN_OPTIONS}.")
    return options


def build_trainer(run: str, options: argparse.Namespace, output_dir: str):
    flags = run_options(run)
    trainer_class, config_class = (trl.DPOTrainer, trl.DPOConfig) if "trl" in flags else (DPOTrainer, DPOConfig)
    extra = {"ref_offload": True} if "ref_offload" in flags else {}
    batch_size = options.batch_size
    if options.joined_processes != 1 and not (options.prompt_groups and "trl" in flags):
        raise ValueError(f"--joined-processes is for 'trl' runs with --prompt-groups, not {run!r}.")
    if options.prompt_groups and "trl" in flags:
        trainer_class = TRLOnPromptGroups
        batch_size *= options.joined_processes
    elif options.prompt_groups:
        extra["train_sampling_strategy"] = "group_by_prompt"
    if "sp" in flags:
        extra["sequence_parallel_size"] = options.sp_size
    if "cp" in flags:
        extra["context_parallel_size"] = options.cp_size
    if "dynamic" in flags:  # rows over 1, 2 ... cp_size ranks (packing/rank_shares.py)
        extra["dynamic_context_parallel"] = True
    if options.given_batches and "trl" in flags:
        trainer_class = TRLOnGivenBatches
    if "lora" in flags:
        from peft import LoraConfig

        extra_trainer = {"peft_config": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")}
    else:
        extra_trainer = {}
    if options.max_tokens_per_batch:
        extra["max_tokens_per_batch"] = options.max_tokens_per_batch
    if options.save_grads:
        extra["max_grad_norm"] = 0.0
    if "prefix_sharing" in flags:
        extra["prefix_sharing"] = True
    if "sync" in flags:
        extra |= {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5}
    if "aux" in flags:
        extra["router_aux_loss_coef"] = AUX_LOSS_COEF
    if "no_aux" in flags:  # a MoE model trained without its router loss (the way out where a split row refuses it)
        extra["router_aux_loss_coef"] = 0.0
    if "whole_images" in flags:  # every rank of a split row encodes all of the row's images
        extra["deal_images"] = False
    if "sgd" in flags:  # a step proportional to the gradient (AdamW's barely depends on its scale)
        extra["optim"] = "sgd"
    if "bf16_sums" in flags:
        extra["fp32_log_probs"] = False
    if "fp32_sums" in flags:
        extra["fp32_log_probs"] = True
    if "fp32_head" in flags:
        extra["cast_lm_head_to_fp32"] = True
    if "balanced" in flags:
        extra["train_sampling_strategy"] = "batch_rebalance"
    if "bf16_weights" in flags:  # TRL loads a model named by path in float32 unless told
        extra["model_init_kwargs"] = {"dtype": "bfloat16"}
    model = model_path(run, options)
    args = config_class(
        output_dir=output_dir,
        padding_free="padding_free" in flags,
        precompute_ref_log_probs="precompute" in flags,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        gradient_accumulation_steps=options.grad_accum,
        max_steps=options.steps,
        learning_rate=options.learning_rate,
        lr_scheduler_type="constant",
        max_length=options.max_length,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16="bf16" in flags,
        activation_checkpointing="checkpointing" in flags,
        seed=0,
        **extra,
    )
    ref_model = None
    if "explicit_ref" in flags:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto_class = AutoModelForImageTextToText if options.vision else AutoModelForCausalLM
        with zero3_init_config(None):  # a plain model, as a user would load it
            ref_model = auto_class.from_pretrained(model, dtype=torch.float32)
    if options.vision:
        dataset, processing_class = vision_data(model, options)
    elif options.prompt_groups:
        dataset, processing_class = prompt_group_data(model, options)
    else:
        dataset, processing_class = text_data(model, options)
    if options.pairs:
        dataset = dataset.select([int(index) for index in options.pairs.split(",")])
    trainer = trainer_class(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=dataset,
        processing_class=processing_class,
        **extra_trainer,
    )
    if trainer_class is TRLOnPromptGroups:
        trainer.joined_processes = options.joined_processes
    if trainer_class is TRLOnGivenBatches:
        trainer.given_batches = json.loads(Path(options.given_batches).read_text())
    if getattr(trainer, "_row_split", None) is not None and trainer._row_split.blocks is not None:
        trainer._row_split.mark = RanksRecorder(trainer._row_split.mark)
    collator = PairRecorder(trainer.data_collator) if options.prompt_groups else trainer.data_collator
    trainer.data_collator = RowRecorder(collator)
    if options.save_grads:
        trainer.add_callback(FirstStepGradients(options.save_grads.replace("{run}", run), trainer))
    trainer.add_callback(PrecisionProbe(trainer))
    return trainer


def text_data(model: str, options: argparse.Namespace):
    """The shipped preference set's first `--num-pairs` pairs and the shipped tokenizer (or the model's own)."""
    if options.model_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    else:
        tokenizer = load_demo_tokenizer()
    return load_demo_dataset("train").select(range(options.num_pairs)), tokenizer


def prompt_group_data(model: str, options: argparse.Namespace):
    """Prompt groups from the shipped pairs: prompt i is pair i's prompt, its K completions the first K of the chosen
    and rejected completions of pairs i, i + 1, ... (of other prompts, but text the tokenizer knows), scored
    distinctly, so that `pair_scored_completions` makes K(K-1)/2 pairs of each, next to each other."""
    from datasets import Dataset

    _, tokenizer = text_data(model, options)
    shipped = load_demo_dataset("train")
    k = options.prompt_groups
    if options.group_prompts:  # chosen by the caller, e.g. prompts of a few hundred tokens
        prompts = [int(index) for index in options.group_prompts.split(",")]
    else:
        prompts = list(range(options.num_pairs))
    texts = [
        text for index in range(max(prompts) + k) for text in (shipped[index]["chosen"], shipped[index]["rejected"])
    ]
    rows = {
        "prompt": [shipped[index]["prompt"] for index in prompts],
        "completions": [texts[2 * index : 2 * index + k] for index in prompts],
        "scores": [[(position + index) % k for position in range(k)] for index in range(len(prompts))],  # best: varies
    }
    return pair_scored_completions(Dataset.from_dict(rows), "all_pairs"), tokenizer


class JoinedBatches:
    """`sampler`'s batches, `joined` consecutive ones together: what `joined` processes, dealt them round-robin by
    accelerate, run in one step."""

    def __init__(self, sampler, joined: int):
        self.sampler, self.joined = sampler, joined

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.joined)

    def __iter__(self):
        batches = list(self.sampler)
        for start in range(0, len(batches), self.joined):
            yield [index for batch in batches[start : start + self.joined] for index in batch]


class TRLOnPromptGroups(trl.DPOTrainer):
    """TRL's padded trainer fed the batches `train_sampling_strategy="group_by_prompt"` makes of its tokenized
    training set (the same sampler, arguments and seed as this package's trainer), `joined_processes` of them in each
    micro-batch."""

    joined_processes = 1

    def get_train_dataloader(self):
        args = self.args
        self.prompt_group_sampler = PromptGroupBatchSampler(
            PairUnits.by_group_id(prompt_group_ids(self.train_dataset)),
            args.per_device_train_batch_size // self.joined_processes,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            drop_last=args.dataloader_drop_last,
        )
        batches = JoinedBatches(self.prompt_group_sampler, self.joined_processes)
        dataset = self._remove_unused_columns(self.train_dataset, description="Training")
        return batch_sampler_dataloader(batches, dataset, self.data_collator, args, self.accelerator)


class TRLOnGivenBatches(trl.DPOTrainer):
    """TRL's padded trainer fed `given_batches` (lists of dataset indices), one per optimizer step, in order: one
    process standing in for every process of a run whose steps trained those pairs."""

    given_batches: list[list[int]] = []

    def get_train_dataloader(self):
        dataset = self._remove_unused_columns(self.train_dataset, description="Training")
        return batch_sampler_dataloader(self.given_batches, dataset, self.data_collator, self.args, self.accelerator)


class RanksRecorder:
    """`RowSplit.mark` under dynamic context parallelism, recording over how many ranks each training row this
    process ran was split, and the row's boundaries and length."""

    def __init__(self, mark):
        self.mark, self.rows = mark, []

    def __call__(self, packed_batch, row_ranks: int) -> None:
        self.rows.append((packed_batch.host.cu_seq_lens, packed_batch.row_length, row_ranks))
        self.mark(packed_batch, row_ranks)

    def sequences_split(self) -> int:
        """How many sequences of this process's rows straddle a boundary between two ranks' chunks."""
        split = 0
        for boundaries, row_length, ranks in self.rows:
            cuts = [row_length // ranks * rank for rank in range(1, ranks)]
            split += sum(any(start < cut < end for cut in cuts) for start, end in pairwise(boundaries))
        return split


def dynamic_plan(sampler, epochs: int = 2) -> list[list[list[tuple[list[int], int, int]]]]:
    """Dynamic context parallelism's first `epochs` epochs: per micro-step, per group, each row's pairs, first rank and
    ranks."""
    plan = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        plan += [
            [[(list(pairs), share.first_rank, share.ranks) for pairs, share in rows] for rows in groups]
            for groups in sampler.epoch_micro_steps()
        ]
    return plan


def pair_digest(*token_lists) -> str:
    """A short digest of a pair's (or a prompt's) token ids, to compare batches across processes."""
    data = b"|".join(array("q", tokens).tobytes() for tokens in token_lists)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class PairRecorder:
    """The collator, recording each batch's pairs and distinct prompts (digests of their token ids)."""

    def __init__(self, collator):
        self.collator = collator
        self.batches = []

    def __call__(self, examples):
        completions = {
            pair_digest(e["prompt_ids"], e[side]): len(e[side])
            for e in examples
            for side in ("chosen_ids", "rejected_ids")
        }
        self.batches.append(
            {
                "pairs": sorted(pair_digest(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in examples),
                "prompts": sorted({pair_digest(e["prompt_ids"]) for e in examples}),
                # tokens of each distinct prompt, and of each distinct completion (untruncated) of the batch
                "prompt_tokens": sorted({len(e["prompt_ids"]) for e in examples}),
                "completion_tokens": sorted(completions.values()),
            }
        )
        return self.collator(examples)


def prompt_group_report(trainer) -> dict:
    """With --prompt-groups: every process's recorded batches (`batches[process][micro_batch]`, all processes join the
    gather) and packed rows, the epoch's grouped batches of pair indices and each pair's digest."""
    recorded = (trainer.data_collator.collator.batches, trainer.data_collator.rows)
    if torch.distributed.is_initialized():
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, recorded)
    else:
        gathered = [recorded]
    if isinstance(trainer, TRLOnGivenBatches):
        grouped_batches = trainer.given_batches
    else:
        grouped_batches = epoch_micro_batches(
            getattr(trainer, "prompt_group_sampler", None) or trainer._batches.sampler, 0
        )
    dataset = trainer.train_dataset
    return {
        "batches": [batches for batches, _ in gathered],
        # padding-free: `rows[process][micro_batch]`, the packed row that process collated, [boundaries, length]
        "rows": [rows for _, rows in gathered],
        "grouped_batches": grouped_batches,
        "pairs": [
            pair_digest(*tokens)
            for tokens in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"], strict=True)
        ],
    }


def vision_data(model: str, options: argparse.Namespace):
    """`--num-pairs` pairs with images from tests/support/tiny_vision/ for the model saved at `model`, and its processor:
    the one saved with it, or for a family whose processor here cannot be saved (no video processor, or a stand-in)
    the same one built again."""
    from datasets import Dataset
    from transformers import AutoConfig, AutoProcessor

    # tests/, where tiny_vision/ lives: not on the path of a script launched from tests/support/distributed/
    tests = str(Path(__file__).resolve().parent.parent)
    if tests not in sys.path:
        sys.path.append(tests)
    from tiny_vision import make_vision_processor, vision_preference_rows

    model_type = AutoConfig.from_pretrained(model).model_type
    images_per_row = [int(count) for count in options.images_per_row.split(",")]
    rows = vision_preference_rows(model_type, options.num_pairs, images_per_row=images_per_row)
    saved = (Path(model) / "processor_config.json").exists() or (Path(model) / "preprocessor_config.json").exists()
    return Dataset.from_list(rows), AutoProcessor.from_pretrained(model) if saved else make_vision_processor(
        model_type
    )


class FirstStepGradients(TrainerCallback):
    """Saves the gradients the first optimizer step applies (after the data-parallel reduction), from process 0.
    Under DeepSpeed ZeRO-3 the engine steps inside accelerate's backward, before this callback's hook, with each
    gradient partitioned over the processes: its `step` is wrapped to gather them first (`safe_get_full_grad`)."""

    def __init__(self, path: str, trainer):
        self.path = path
        self.trainer = trainer
        self.saved = False

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        if getattr(self.trainer.accelerator.state.deepspeed_plugin, "zero_stage", None) != 3:
            return
        from deepspeed.utils import safe_get_full_grad

        step = engine.step

        def step_after_saving(*step_args, **step_kwargs):
            if not self.saved and engine.is_gradient_accumulation_boundary():
                grads = {}
                for name, p in engine.module.named_parameters():
                    grad = safe_get_full_grad(p) if p.requires_grad else None  # every process joins the gather
                    if grad is not None:
                        grads[name] = grad.detach().cpu().clone()
                self.save(grads, state.is_world_process_zero)
            return step(*step_args, **step_kwargs)

        engine.step = step_after_saving

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        if not self.saved:
            # FSDP2 holds each gradient as a DTensor shard: every process joins in gathering it
            grads = {
                name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu()
                for name, p in model.named_parameters()
                if p.grad is not None
            }
            self.save(grads, state.is_world_process_zero)

    def save(self, grads: dict, process_zero: bool) -> None:
        if process_zero and grads:
            torch.save(grads, self.path)
        self.saved = True


class PrecisionProbe(TrainerCallback):
    """Records the dtypes of the log-prob computation's stages in the first training forward of the policy, as TRL's
    loss reads them: the backbone's hidden states, the logits tiles of TRL's fused LM head (float32 with
    `cast_lm_head_to_fp32`, else the autocast or hidden dtype: trl/kernels/chunked_logprob.py's `compute_dtype`), and the
    per-token log-probs the engine hands back (their per-sequence sums keep that dtype)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.dtypes = {}
        self.hooks = []

    def on_train_begin(self, args, state, control, **kwargs):
        policy = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
        self.hooks = [
            policy.base_model.register_forward_hook(self.backbone_output),
            self.trainer.model_wrapped.register_forward_hook(self.model_output),
        ]

    def backbone_output(self, module, args, output):
        if "hidden_states" not in self.dtypes and module.training and hasattr(output, "last_hidden_state"):
            hidden = output.last_hidden_state.dtype
            device = output.last_hidden_state.device.type
            autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            fp32 = getattr(self.trainer.args, "cast_lm_head_to_fp32", False) and isinstance(self.trainer, DPOTrainer)
            self.dtypes["hidden_states"] = str(hidden)
            self.dtypes["autocast"] = str(autocast)
            self.dtypes["logits"] = str(torch.float32 if fp32 else autocast or hidden)

    def model_output(self, module, args, output):
        if "log_probs" not in self.dtypes and getattr(output, "log_probs", None) is not None and module.training:
            self.dtypes["log_probs"] = str(output.log_probs.dtype)
            for hook in self.hooks:
                hook.remove()


class RowRecorder:
    """The collator, recording each packed row's segment boundaries and length (sequence parallelism pads the row)."""

    def __init__(self, collator):
        self.collator = collator
        self.rows = []
        self.image_spans = []  # per row, the (start, end) of each run of image tokens

    def __call__(self, examples):
        batch = self.collator(examples)
        if "cu_seq_lens_q" in batch:
            self.rows.append((batch["cu_seq_lens_q"].tolist(), batch["input_ids"].shape[1]))
            image_token_id = getattr(self.collator, "image_token_id", None)
            if image_token_id is None and hasattr(self.collator, "processor"):
                from trl_padfree.packing.vision import image_token_id_of

                image_token_id = image_token_id_of(self.collator.processor)
            if image_token_id is not None:
                flags = (batch["input_ids"][0] == image_token_id).tolist() + [False]
                starts = [index for index, flag in enumerate(flags) if flag and (index == 0 or not flags[index - 1])]
                ends = [index for index, flag in enumerate(flags) if not flag and index and flags[index - 1]]
                self.image_spans.append(list(zip(starts, ends, strict=True)))
        return batch

    def rows_with_images_on_one_rank(self, sp_size: int) -> int:
        """How many rows with images hold all of them in one rank's chunk (the other ranks place no image)."""
        count = 0
        for spans, (_, row_length) in zip(self.image_spans, self.rows, strict=False):
            chunk = row_length // sp_size
            count += (
                bool(spans)
                and len({start // chunk for start, _ in spans} | {(end - 1) // chunk for _, end in spans}) == 1
            )
        return count

    def images_split(self, sp_size: int) -> int:
        """How many images' token runs straddle a boundary between two ranks' chunks of their row."""
        split = 0
        for spans, (_, row_length) in zip(self.image_spans, self.rows, strict=False):
            cuts = [row_length // sp_size * rank for rank in range(1, sp_size)]
            split += sum(any(start < cut < end for cut in cuts) for start, end in spans)
        return split

    def longest_over_chunk(self, sp_size: int) -> float:
        """The longest sequence of any row over the length of one rank's chunk of its row (> 1: it spans ranks)."""
        return max(
            (
                max(end - start for start, end in pairwise(boundaries)) / (row_length // sp_size)
                for boundaries, row_length in self.rows
            ),
            default=0.0,
        )

    def sequences_split(self, sp_size: int) -> int:
        """How many sequences straddle a boundary between two ranks' chunks of their row."""
        split = 0
        for boundaries, row_length in self.rows:
            cuts = [row_length // sp_size * rank for rank in range(1, sp_size)]
            split += sum(any(start < cut < end for cut in cuts) for start, end in pairwise(boundaries))
        return split


def epoch_micro_batches(sampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def fsdp_layout(model) -> dict | None:
    """How FSDP2 holds `model`: None if it is not an FSDP2 module, else whether every parameter is a DTensor shard
    (smaller than the whole), how many FSDP units it has (the root and one per wrapped layer), and whether its
    shards are kept in CPU memory by FSDP2's CPU offload policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        return None
    parameters = list(model.parameters())
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    # torch's own record of the policy each unit was built with (private: this is a test's look inside)
    groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units]
    policies = [group.offload_policy for group in groups if group is not None]
    return {
        "sharded": all(isinstance(p, DTensor) for p in parameters)
        and sum(p.to_local().numel() for p in parameters) < sum(p.numel() for p in parameters),
        "units": len(units),
        "cpu_offload": bool(policies) and all(isinstance(policy, CPUOffloadPolicy) for policy in policies),
        "local_devices": sorted({p.to_local().device.type for p in parameters}),
    }


def gathered_peak_bytes(model) -> int:
    """The most bytes of `model`'s parameters held unsharded (plain tensors, not DTensor shards) at the start of any
    of its modules' forwards, over one forward of a short row: what FSDP2 gathers at once."""
    from torch.distributed.tensor import DTensor

    peak = 0

    def count(module, args):
        nonlocal peak
        gathered = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
        peak = max(peak, gathered)

    hooks = [module.register_forward_pre_hook(count) for module in model.modules()]
    try:
        with torch.no_grad():
            # the row's boundaries given: a model with positions of its own (PaddleOCR-VL's mRoPE) hands the
            # attention no plain position_ids to read them from
            boundaries = torch.tensor([0, 8], dtype=torch.int32)
            # and a hybrid model's stateful mixers (LFM3's short convolutions) their one segment, as the packed
            # forward hands them theirs: they refuse a row with boundaries and no segments
            segments = {SEGMENTS_KWARG: MixerSegments.from_lengths([8])} if stateful_mixers(model) else {}
            model(input_ids=torch.arange(1, 9).unsqueeze(0), cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries,
                  max_length_q=8, max_length_k=8, use_cache=False, **segments)  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    return peak


def zero_optimizer_partitioned(trainer) -> bool | None:
    """Under DeepSpeed ZeRO-1 or 2 (whose parameters stay whole): whether this process's float32 master weights, and
    with them its optimizer states, are a partition smaller than the trainable parameters; None under other engines."""
    engine = trainer.model_wrapped
    partitions = getattr(getattr(engine, "optimizer", None), "single_partition_of_fp32_groups", None)
    if not partitions:
        return None
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return sum(p.numel() for p in partitions) < trainable


def describe(trainer) -> dict:
    sp_size = sequence_parallel_size(trainer.accelerator)
    row_split = getattr(trainer, "_row_split", None)
    cp_size = row_split.context.size if row_split is not None and row_split.context is not None else 1
    budget = trainer._batches.budget_sampler if isinstance(trainer, DPOTrainer) else None
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    parameters = list(policy.parameters())
    plugin = trainer.accelerator.state.deepspeed_plugin
    fsdp_plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
    reference_layout = fsdp_layout(trainer.ref_model)
    reference_bytes = None
    if trainer.ref_model is not None:
        reference_bytes = sum(p.numel() * p.element_size() for p in trainer.ref_model.parameters())
    probe = next(callback for callback in trainer.callback_handler.callbacks if isinstance(callback, PrecisionProbe))
    return {
        "precision": probe.dtypes,
        "model_type": policy.config.model_type,
        "attn_implementation": policy.config._attn_implementation,
        "dtype": str(parameters[0].ds_tensor.dtype if hasattr(parameters[0], "ds_tensor") else parameters[0].dtype),
        "aux_loss_enabled": trainer.aux_loss_enabled,
        "trl_padfree": trl_padfree.__file__,  # the checkout whose package ran
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "metrics": [entry for entry in trainer.state.log_history if "loss" in entry],
        "world_size": trainer.accelerator.num_processes,
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        # the stage the policy's DeepSpeed engine ran at, and whether its optimizer states were partitioned (ZeRO-1, 2)
        "engine_zero_stage": trainer.model_wrapped.zero_optimization_stage() if plugin is not None else None,
        "optimizer_partitioned": zero_optimizer_partitioned(trainer),
        "reference": {
            "kept": trainer.ref_model is not None,
            "offloaded": trainer.ref_model is not None and zero3_offloaded(trainer.ref_model),
        },
        # Under ZeRO-3 each process holds 1/world of every parameter it partitions
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "policy_sharded": all(hasattr(p, "ds_tensor") for p in parameters)
        and sum(p.ds_tensor.numel() for p in parameters) < sum(p.ds_numel for p in parameters),
        "fsdp_version": fsdp_plugin.fsdp_version if fsdp_plugin is not None else None,
        "policy_fsdp": fsdp_layout(policy),
        "reference_fsdp": reference_layout,
        "reference_gathered_peak_bytes": gathered_peak_bytes(trainer.ref_model) if reference_layout else None,
        "reference_bytes": reference_bytes,
        "sequence_parallel_size": sp_size,
        "context_parallel_size": cp_size,
        "sequences_split_across_ranks": trainer.data_collator.sequences_split(sp_size * cp_size),
        "images_split_across_ranks": trainer.data_collator.images_split(sp_size * cp_size),
        "rows_with_images_on_one_rank": trainer.data_collator.rows_with_images_on_one_rank(sp_size * cp_size),
        # training rows with images this process ran, by how the vision tower ran (parallel/image_shares.py)
        "vision_tower_rows": trainer._row_split.image_rows if getattr(trainer, "_row_split", None) else None,
        "longest_sequence_over_chunk": trainer.data_collator.longest_over_chunk(sp_size * cp_size),
        # token-budget batching: every micro-batch of the epoch, in the order the processes share them out
        "train_pairs": len(trainer.train_dataset),
        "micro_batches": epoch_micro_batches(budget, 0) if budget is not None else None,
        "balanced": balanced_steps(trainer),
        "dynamic": dynamic_report(trainer),
    }


def dynamic_report(trainer) -> dict | None:
    """Under dynamic context parallelism: the first epochs' plan (`dynamic_plan`), and this process's rows: the ranks
    each was split over, and how many sequences crossed a chunk boundary."""
    row_split = getattr(trainer, "_row_split", None)
    if row_split is None or row_split.blocks is None:
        return None
    return {
        "plan": dynamic_plan(trainer._batches.sampler),
        "row_ranks": [ranks for _, _, ranks in row_split.mark.rows],
        "sequences_split": row_split.mark.sequences_split(),
    }


def balanced_steps(trainer) -> dict | None:
    """With batch_rebalance: each step's rows (`bins[micro_step][process]`, dataset indices) as balanced and as the
    default sampler deals the same pairs, and the estimated cost ratio of both."""
    balanced = trainer._batches if isinstance(trainer, DPOTrainer) else None
    if balanced is None or balanced.shape is None:  # priced: batch_rebalance
        return None
    sampler = balanced.sampler
    sampler.set_epoch(0)
    dealt, split = list(sampler.dealt_bins()), list(sampler.step_bins())
    return {
        "bins": split,
        "dealt_bins": dealt,
        "imbalance": [imbalance(bin_costs(sampler.costs, bins)) for bins in split],
        "dealt_imbalance": [imbalance(bin_costs(sampler.costs, bins)) for bins in dealt],
    }


def main(argv=None) -> None:
    options = parse_args(argv)
    output = Path(options.output)
    reports = {}
    for run in options.runs.split(","):
        if options.watchdog:  # armed anew for each run (it replaces the previous run's)
            faulthandler.dump_traceback_later(options.watchdog, exit=True)
        start = time.perf_counter()
        trainer = build_trainer(run, options, str(output.parent / f"{output.stem}-{run}"))
        if options.count_collectives:
            from step_collectives import StepCollectives

            counts = StepCollectives()
            trainer.add_callback(counts)
        trainer.train()
        reports[run] = describe(trainer)
        if options.prompt_groups:
            reports[run]["prompt_groups"] = prompt_group_report(trainer)
        if options.count_collectives:
            reports[run]["collectives"] = counts.steps
        reports[run]["seconds"] = time.perf_counter() - start  # building the trainer and training, this process
        if "eval" in run_options(run):
            # pairs of the tokenized training set: none of them dropped for length
            reports[run]["eval"] = trainer.evaluate(trainer.train_dataset.select(range(8)))
        is_main_process = trainer.accelerator.is_main_process
        del trainer
    if is_main_process:
        output.write_text(json.dumps(reports, indent=1))
    faulthandler.cancel_dump_traceback_later()
    # torch's gloo workers may still be releasing the last collectives (trl_padfree.cli.exit_without_finalizing)
    if torch.distributed.is_initialized():
        exit_without_finalizing()


if __name__ == "__main__":
    main()
