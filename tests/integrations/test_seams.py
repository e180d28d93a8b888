"""Every seam trl-padfree cuts into the libraries under it, in one table, each checked against the installed version.

trl-padfree subclasses TRL's `DPOTrainer` and relies on private parts of TRL, transformers, accelerate, DeepSpeed,
torch and PEFT: private attributes and functions, module-level names it reroutes while TRL's `__init__` runs, lines of
their code that must still call what it reroutes, signatures it calls or overrides by position. After a version bump,
a seam that moved fails here, one line each naming the library, the name and the trl-padfree module that depends on
it, instead of as hundreds of numerical failures elsewhere.

    python -m pytest tests/integrations/test_seams.py -q -p no:cacheprovider

Each `Seam` is checked the way it matters:
- `name` resolves (the longest importable module, then attributes), unless `where` names what to inspect instead;
- `parameters`: its signature starts with these, in this order (called or overridden by position);
- `keywords`: its signature has these parameters (passed by name, or read as fields of a dataclass);
- `check`: a predicate on the object (a value, an identity, a type), with what it expects;
- `source`: lines that the libraries' own code must still contain (`{dotted name: snippets}`), for seams that are
  calls the library makes: a rerouted module-level name, an attribute its `__init__` sets; with `ordered`, in order.
DeepSpeed seams are skipped when DeepSpeed is not installed.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from trl_padfree.features.pair_weighted_steps import (
    PER_PAIR_METRICS,  # TRL's metrics that uneven micro-batches reweigh by pairs
)
from trl_padfree.modeling.attention.interface import CHUNKED_LAYER_TYPE
from trl_padfree.modeling.backends import FLASH_VARLEN
from trl_padfree.plan.memory import LOGITS_TILE_TOKENS, LOGITS_TILE_VOCAB
from trl_padfree.refusals.token_budget import COUPLED_LOSS_TYPES
from trl_padfree.settings import REBALANCE


@dataclass(frozen=True)
class Check:
    """A predicate on the resolved object, and what it expects (for the failure message)."""

    expects: str
    holds: Callable[[Any], bool]


def equals(value) -> Check:
    return Check(f"equal to {value!r}", lambda obj: obj == value)


def same_object_as(dotted: str) -> Check:
    return Check(f"the same object as `{dotted}`", lambda obj: obj is resolve(dotted))


def instance_of(kind: type | str) -> Check:
    """`kind` a type, or the dotted name of one."""
    name = kind if isinstance(kind, str) else kind.__name__
    return Check(
        f"an instance of `{name}`", lambda obj: isinstance(obj, resolve(kind) if isinstance(kind, str) else kind)
    )


def has_attributes(*names: str) -> Check:
    return Check(f"attributes {list(names)}", lambda obj: all(hasattr(obj, name) for name in names))


def has_keys(*keys: str) -> Check:
    return Check(f"keys {list(keys)}", lambda obj: set(keys) <= set(getattr(obj, "__annotations__", obj)))


def is_property() -> Check:
    return Check("a property (read and set by trl-padfree)", lambda obj: isinstance(obj, property) and obj.fset)


@dataclass(frozen=True)
class Seam:
    library: str
    name: str  # what trl-padfree uses, dotted from the library's top-level package
    relied_on: str
    used_in: str  # the trl-padfree modules that depend on it
    where: str | None = None  # what to resolve and inspect, when `name` is not importable (an instance attribute)
    parameters: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    check: Check | None = None
    source: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ordered: bool = False

    @property
    def id(self) -> str:
        return f"{self.library}:{self.name}"


INIT = "trl.trainer.dpo_trainer.DPOTrainer.__init__"
COMPUTE_LOSS = "trl.trainer.dpo_trainer.DPOTrainer._compute_loss"
PRECOMPUTE = "trl.trainer.dpo_trainer.DPOTrainer._precompute_ref_logps"
FUSED_HEAD = "trl.trainer.utils.add_fused_lm_head"
VISION_COLLATE = "trl.trainer.dpo_trainer.DataCollatorForVisionPreference.torch_call"
# How TRL hands every batch key but these to the model, so the packed batch reaches the packed forward as a keyword
MODEL_KWARGS = "model_kwargs = {k: v for k, v in inputs.items() if k not in _non_model_keys}"

TRL = [
    Seam(
        "trl", "trl.DPOTrainer", "the trainer subclassed; the range it was written against is pinned in _compat.py",
        "trainer.py", check=instance_of(type),
    ),
    Seam(
        "trl", "trl.DPOTrainer.__init__",
        "takes (model, ref_model, args, data_collator, ...) by position and `peft_config` by name: the subclass "
        "passes them on, and `_bound_argument` reads `peft_config` however it was passed",
        "trainer.py", parameters=("self", "model", "ref_model", "args", "data_collator"), keywords=("peft_config",),
    ),
    Seam(
        "trl", "trl.DPOTrainer.padding_free",
        "TRL's `__init__` reads `args.padding_free` (and switches it off with a warning): hidden from it while it "
        "runs",
        "trainer.py", where=INIT, source={INIT: ("self.padding_free = args.padding_free",)},
    ),
    Seam(
        "trl", "trl.DPOTrainer._tag_names", "a private class attribute: the model card tags, extended",
        "integrations/trl.py", check=instance_of(list),
    ),
    Seam(
        "trl", "trl.DPOTrainer._precompute_ref_logps",
        "private, overridden to enable packing first: TRL's `__init__` precomputes reference log-probs through it, "
        "and it computes them through `compute_ref_log_probs`",
        "integrations/trl.py", parameters=("self", "dataset", "name", "batch_size"),
        source={
            INIT: ("self.train_dataset = self._precompute_ref_logps(",),
            PRECOMPUTE: ("self.compute_ref_log_probs(model, padded_batch)",),
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer.compute_ref_log_probs",
        "overridden to unpack packed batches; passes every batch key but `_non_model_keys` to the model, with "
        "`labels` and `fused_lm_head=True`",
        "trainer.py, modeling/packed_forward.py", parameters=("self", "model", "inputs"),
        source={
            "trl.trainer.dpo_trainer.DPOTrainer.compute_ref_log_probs": (
                MODEL_KWARGS,
                "model(**model_kwargs, labels=labels, fused_lm_head=True).log_probs",
            )
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer.compute_loss",
        "overridden; the subclass calls it positionally (model, inputs, return_outputs, num_items_in_batch), and it "
        "computes the loss in `_compute_loss`",
        "trainer.py", parameters=("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
        source={
            "trl.trainer.dpo_trainer.DPOTrainer.compute_loss": ("self._compute_loss(model, inputs, return_outputs)",)
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer._compute_loss",
        "private, not overridden: hands the policy and the reference every batch key but `_non_model_keys` (the "
        "packed batch travels as a keyword), and reads per-token log-probs in the `(rows, len - 1)` layout the packed "
        "forward returns",
        "trainer.py, modeling/packed_forward.py", parameters=("self", "model", "inputs", "return_outputs"),
        source={
            COMPUTE_LOSS: (
                MODEL_KWARGS,
                "outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)",
                "per_token_logps = outputs.log_probs[:, -seq_len:]",
                "self.ref_model(**ref_model_kwargs, labels=labels, fused_lm_head=True)",
            )
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer.prediction_step",
        "overridden, called positionally; TRL's prepares the inputs again and returns `inputs['input_ids']` as labels",
        "trainer.py", parameters=("self", "model", "inputs", "prediction_loss_only", "ignore_keys"),
        source={
            "trl.trainer.dpo_trainer.DPOTrainer.prediction_step": (
                "inputs = self._prepare_inputs(inputs)",
                'logits, labels = outputs.logits, inputs["input_ids"]',
            )
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer.log",
        "overridden to weigh per-pair metrics by pairs and add padfree/tokens_per_second; TRL's averages each "
        "metric's list equally", "trainer.py", parameters=("self", "logs", "start_time"),
        source={
            "trl.trainer.dpo_trainer.DPOTrainer.log": (
                "metrics = {key: sum(val) / len(val) for key, val in self._metrics[mode].items()}",
            )
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer.create_model_card",
        "overridden to append the padding-free settings to the card TRL writes as README.md in output_dir",
        "trainer.py", parameters=("self", "model_name", "dataset_name", "tags"),
        source={
            "trl.trainer.base_trainer._BaseTrainer.create_model_card": (
                'model_card.save(os.path.join(self.args.output_dir, "README.md"))',
            )
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer._metrics",
        "private: per-mode lists of per-micro-batch values; trl-padfree appends its padfree/* metrics and reweighs "
        "the per-pair means TRL appends (PER_PAIR_METRICS)",
        "integrations/trl.py", where=INIT,
        source={
            INIT: ('self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}',),
            COMPUTE_LOSS: tuple(f'self._metrics[mode]["{key}"].append(' for key in PER_PAIR_METRICS),
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer._tp_size",
        "private: TRL divides its token count by it; multiplied by the sequence/context-parallel group size so "
        "tokens a group shares count once",
        "integrations/trl.py", where=INIT,
        source={INIT: ("self._tp_size =",), COMPUTE_LOSS: ("num_tokens_in_batch // self._tp_size",)},
    ),
    Seam(
        "trl", "trl.DPOTrainer._is_vision_dataset",
        "private: set by TRL's `__init__`; a vision set gets the vision collator's packing twin and image checks",
        "integrations/trl.py", where=INIT, source={INIT: ("self._is_vision_dataset =",)},
    ),
    Seam(
        "trl", "trl.trainer.dpo_trainer.DataCollatorForVisionPreference",
        "subclassed (the packing twin) and called untruncated: its fields are copied by name, its rows are every "
        "chosen then every rejected sequence, cut to the first `max_length` tokens (applied again when packing, "
        "where a cut image can be told from a kept one)",
        "integrations/trl.py, packing/vision.py",
        keywords=("processor", "max_length", "pad_to_multiple_of", "return_tensors"),
        source={
            VISION_COLLATE: (
                "input_ids = input_ids[:, : self.max_length]",
                "completion_mask = completion_mask[:, : self.max_length]",
            )
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer.__init__ (vision refusals)",
        "TRL refuses `keep_end` truncation and precomputed reference log-probs on vision sets itself; trl-padfree "
        "keeps those refusals rather than repeating them",
        "packing/vision.py", where=INIT,
        source={INIT: ("truncation_mode='keep_end' is not supported for vision-language models",
                       "`precompute_ref_log_probs=True` is not supported for vision datasets")},
    ),
    Seam(
        "trl", "trl.trainer.dpo_trainer.DPOTrainer._compute_loss (loss types)",
        "balanced batches refuse the loss types whose value couples a micro-batch's pairs (COUPLED_LOSS_TYPES: "
        "sorted across the batch, or a mean over the batch's tokens); every other loss type is a per-pair mean",
        "refusals/token_budget.py, features/batches.py", where=COMPUTE_LOSS,
        source={
            COMPUTE_LOSS: (
                "logratios_sorted, _ = torch.sort(logratios, dim=0)",
                "chosen_logratios_sorted, _ = torch.sort(chosen_logratios, dim=0)",
                "batch_loss = -chosen_per_token_logps[chosen_mask.bool()].mean()",
                "loss += per_sequence_loss.mean() * loss_weight",
                *(f'loss_type == "{name}"' for name in COUPLED_LOSS_TYPES),
            )
        },
    ),
    Seam(
        "transformers", "transformers.TrainingArguments.train_sampling_strategy",
        f"its '{REBALANCE}' turns balanced batches on under padding-free (transformers' own BatchRebalanceSampler "
        "otherwise); the Trainer's dataloader is replaced, and accelerate's SeedableRandomSampler order reproduced "
        "(seed + epoch, torch.randperm)",
        "features/batches.py, trainer.py", where="transformers.TrainingArguments",
        check=has_attributes("train_sampling_strategy"),
        source={
            "transformers.TrainingArguments": (f'"{REBALANCE}"',),
            "accelerate.data_loader.SeedableRandomSampler.__iter__": (
                "seed = self.epoch + self.initial_seed",
                "self.generator.manual_seed(seed)",
            ),
            "accelerate.data_loader.BatchSamplerShard.__init__": (
                'self.batch_size = getattr(batch_sampler, "batch_size", None)',
            ),
        },
    ),
    Seam(
        "trl", "trl.DPOTrainer.aux_loss_enabled",
        "set by TRL's `__init__` before it adds the fused LM heads; read to refuse MoE aux loss with row padding, "
        "prefix sharing and split rows, and by fused_lm_head_lookups after `__init__`",
        "refusals/models.py, refusals/parallel.py, features/padding_free.py, modeling/fused_lm_head.py, features/row_split.py", where=INIT, ordered=True,
        source={INIT: ("self.aux_loss_enabled =", "add_fused_lm_head(")},
    ),
    Seam(
        "trl", "trl.trainer.dpo_trainer.add_fused_lm_head",
        "module-level name TRL's `__init__` calls for the policy and the reference; rerouted while it runs (model "
        "first) so each patched model is prepared",
        "modeling/fused_lm_head.py", parameters=("model",), check=same_object_as(FUSED_HEAD),
        source={INIT: ("add_fused_lm_head(",)},
    ),
    Seam(
        "trl", FUSED_HEAD,
        "the forward it installs looks up `base_model`, `get_output_embeddings()`, `text_config.num_experts` and "
        "`num_experts_per_tok` on every call, and takes `fused_lm_head`, `labels` and pre-shifted `shift_labels` "
        "(split rows) by keyword; `cast_lm_head_to_fp32` (the option of that name) projects in float32 outside "
        "autocast; its log-probs are float32 whatever the model's dtype (`fp32_log_probs` keeps them so under FSDP2)",
        "modeling/fused_lm_head.py, modeling/packed_forward.py", parameters=("model",),
        keywords=("cast_lm_head_to_fp32",),
        source={
            FUSED_HEAD: (
                "hidden_states = hidden_states.float()",
                "autocast_ctx = torch.autocast(hidden_states.device.type, enabled=False)",
                "text_config = model.config.get_text_config()",
                'backbone_attr = "base_model"',
                "self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs",
                "getattr(self, backbone_attr)(*args, **kwargs)",
                "lm_head = self.get_output_embeddings()",
                "num_experts = text_config.num_experts",
                "num_experts_per_tok = text_config.num_experts_per_tok",
            )
        },
    ),
    Seam(
        "trl", "trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE",
        "private: the vocabulary width of the fused LM head's logits tiles, read by the planner's activation estimate",
        "integrations/trl.py", check=equals(LOGITS_TILE_VOCAB),
        source={FUSED_HEAD: ("_CHUNKED_LOGPROB_CHUNK_SIZE,",)},
    ),
    Seam(
        "trl", "trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE",
        "the token height of the fused LM head's logits tiles, read by the planner's activation estimate",
        "integrations/trl.py, plan/memory.py", check=equals(LOGITS_TILE_TOKENS),
        source={"trl.kernels.chunked_logprob": ("for token_start in range(0, N, TOKEN_CHUNK_SIZE):",)},
    ),
    Seam(
        "trl", "trl.trainer.dpo_trainer.prepare_deepspeed",
        "module-level name rerouted while TRL's `__init__` runs (ref_offload under ZeRO-3); its only other use there "
        "is the precompute engine over the policy, when there is no reference",
        "integrations/trl.py, placement/deepspeed.py", parameters=("model", "accelerator"),
        source={
            INIT: ("self.ref_model = prepare_deepspeed(self.ref_model, self.accelerator)",),
            PRECOMPUTE: (
                "if self.ref_model is None and self.is_deepspeed_enabled:",
                "prepare_deepspeed(self.model, self.accelerator)",
            ),
        },
        ordered=True,
    ),
    Seam(
        "trl", "trl.trainer.dpo_trainer.prepare_fsdp",
        "module-level name rerouted while TRL's `__init__` runs (the reference sharded layer by layer under FSDP2)",
        "placement/fsdp2.py", parameters=("model", "accelerator"),
        source={INIT: ("self.ref_model = prepare_fsdp(self.ref_model, self.accelerator)",)},
    ),
    Seam(
        "trl", "trl.trainer.utils.create_model_from_path",
        "loads the offloaded reference as TRL loads its own: same model id and init kwargs (device_map None, "
        "trust_remote_code, the policy's dtype and attention)",
        "integrations/trl.py, placement/deepspeed.py", parameters=("model_id",),
        source={
            INIT: (
                'ref_model_init_kwargs["device_map"] = None',
                'ref_model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)',
                'ref_model_init_kwargs.setdefault("dtype", self.model.dtype)',
                'ref_model_init_kwargs.setdefault("attn_implementation", self.model.config._attn_implementation)',
                "self.ref_model = create_model_from_path(ref_model_path, **ref_model_init_kwargs)",
            )
        },
    ),
    Seam(
        "trl", "trl.trainer.utils.get_config_model_id", "the policy's checkpoint id", "features/reference_placement.py",
        parameters=("config",),
    ),
    Seam(
        "trl", "trl.trainer.dpo_trainer.DataCollatorForPreference",
        "subclassed; its fields are read and passed by name to build the packed twin (`from_padded`)",
        "packing/collator.py",
        keywords=("pad_token_id", "max_length", "truncation_mode", "pad_to_multiple_of", "return_tensors"),
        check=has_attributes("torch_call"),
    ),
    Seam(
        "trl", "trl.DPOConfig", "subclassed; these fields are read by trl-padfree",
        "config.py, trainer.py, refusals/config.py, refusals/parallel.py, cli/bench/harness.py",
        keywords=(
            "padding_free", "precompute_ref_log_probs", "model_init_kwargs", "trust_remote_code", "use_liger_kernel",
            "max_length", "truncation_mode", "pad_to_multiple_of", "disable_dropout", "parallelism_config",
            "accelerator_config", "seed", "data_seed", "dataloader_num_workers", "dataloader_pin_memory",
            "dataloader_persistent_workers", "dataloader_prefetch_factor", "activation_checkpointing",
        ),
    ),
]  # fmt: skip

QWEN_VL = (
    "qwen2_vl.Qwen2VL",
    "qwen2_5_vl.Qwen2_5_VL",
    "qwen3_vl.Qwen3VL",
    "qwen3_vl_moe.Qwen3VLMoe",
    "qwen3_5.Qwen3_5",
    "qwen3_5_moe.Qwen3_5Moe",
    "glm4v.Glm4v",
    "glm4v_moe.Glm4vMoe",
)
GLM46V = "glm46v.Glm46V"  # GLM-4V's text model behind its own get_rope_index
TRANSFORMERS_VISION = [
    *(
        Seam(
            "transformers",
            f"transformers.models.{family}Model.get_rope_index",
            "the position function called on the packed row's padded view, by keyword",
            "modeling/vision.py",
            keywords=("input_ids", "mm_token_type_ids", "image_grid_thw", "attention_mask"),
        )
        for family in (*QWEN_VL, GLM46V)
    ),
    *(
        Seam(
            "transformers",
            f"transformers.models.{family}TextModel.forward",
            "reads `(4, 1, T)` position_ids as packed: row 0 plain text positions (mask-based attention keeps the "
            "sequences apart), rows 1-3 the rotary positions",
            "modeling/vision.py",
            source={
                f"transformers.models.{family}TextModel.forward": (
                    "if position_ids.ndim == 3 and position_ids.shape[0] == 4:",
                    "text_position_ids = position_ids[0]",
                )
            },
        )
        for family in QWEN_VL
    ),
    *(
        Seam(
            "transformers",
            f"transformers.models.{family}Model.get_image_features",
            "called by the architecture check on a twin's images of different sizes, by keyword; `pooler_output` "
            "holds each image's features, whose lengths are the image tokens the twin's sequences get",
            "modeling/check/family_twins.py",
            keywords=("pixel_values", *size_inputs),
        )
        for family, size_inputs in (
            ("llava_next.LlavaNext", ("image_sizes",)),
            ("llava_next_video.LlavaNextVideo", ("image_sizes",)),
            ("llava_onevision.LlavaOnevision", ("image_sizes", "batch_num_images")),
            ("mistral3.Mistral3", ("image_sizes",)),
            ("lighton_ocr.LightOnOcr", ("image_sizes",)),
            ("lfm2_vl.Lfm2Vl", ("spatial_shapes", "pixel_attention_mask")),
        )
    ),
    *(
        Seam(
            "transformers",
            f"transformers.models.{family}Model.forward",
            "encodes the batch's images with one `self.get_image_features(...)` call, which image_shares.py replaces "
            "on the instance to encode a rank's share and gather every rank's features, and places the output's "
            "`pooler_output` (and Qwen3-VL's `deepstack_features`) on the image tokens",
            "parallel/image_shares.py",
            source={
                f"transformers.models.{family}Model.forward": (
                    "self.get_image_features(",
                    'mm_encoder_outputs["image"].pooler_output',
                    *(['mm_encoder_outputs["image"].deepstack_features'] if family.startswith("qwen3") else []),
                )
            },
        )
        for family in (
            "qwen2_vl.Qwen2VL",
            "qwen2_5_vl.Qwen2_5_VL",
            "qwen3_vl.Qwen3VL",
            "qwen3_vl_moe.Qwen3VLMoe",
            "glm4v.Glm4v",
            "glm4v_moe.Glm4vMoe",
            "glm46v.Glm46V",
            "gemma3.Gemma3",
            "llava.Llava",
            "vipllava.VipLlava",
            "llava_next.LlavaNext",
            "llava_onevision.LlavaOnevision",
            "internvl.InternVL",
            "aya_vision.AyaVision",
            "mistral3.Mistral3",
            "idefics2.Idefics2",
            "idefics3.Idefics3",
            "smolvlm.SmolVLM",
        )  # fmt: skip
    ),
    *(
        Seam(
            "transformers",
            f"transformers.models.{family}Model.forward",
            "encodes the batch's images with one `self.get_image_features(...)` call (replaced by image_shares.py) "
            "and places its `pooler_output` on the image tokens, as the families above",
            "parallel/image_shares.py",
            source={
                f"transformers.models.{family}Model.forward": (
                    "self.get_image_features(",
                    'mm_encoder_outputs["image"].pooler_output',
                    *deepstack,
                )
            },
        )
        for family, deepstack in (
            ("cosmos3_omni.Cosmos3Omni", ['mm_encoder_outputs["image"].deepstack_features']),
            ("hyperclovax_vision_v2.HyperCLOVAXVisionV2", []),
            ("lfm3_vl.Lfm3Vl", []),
            ("video_llava.VideoLlava", []),
            ("qianfan_ocr.QianfanOCR", []),
            ("qwen2_5_omni.Qwen2_5OmniThinker", []),
            ("qwen3_omni_moe.Qwen3OmniMoeThinker", ['mm_encoder_outputs["image"].deepstack_features']),
        )
    ),
    Seam(
        "transformers",
        "transformers.models.cosmos3_omni.Cosmos3OmniModel.get_rope_index",
        "the position function called on the packed row's padded view, by keyword (Qwen3-VL's)",
        "modeling/vision.py",
        keywords=("input_ids", "mm_token_type_ids", "image_grid_thw", "attention_mask"),
    ),
    *(
        seam
        for family in ("qwen2_5_omni.Qwen2_5Omni", "qwen3_omni_moe.Qwen3OmniMoe")
        for seam in (
            Seam(
                "transformers",
                f"transformers.models.{family}ThinkerModel.get_rope_index",
                "the position function called on the packed row's padded view, by keyword and without marks (it "
                "finds each image by the vision-start token before it); the forward calls it only given an attention "
                "mask, which the architecture check hands each sequence alone",
                "modeling/vision.py, modeling/check/packability.py",
                keywords=("input_ids", "image_grid_thw", "attention_mask"),
                source={
                    f"transformers.models.{family}ThinkerModel.compute_3d_position_ids": (
                        "can_compute_mrope = input_ids is not None and attention_mask is not None",
                    )
                },
            ),
            Seam(
                "transformers",
                f"transformers.models.{family}ThinkerTextModel.forward",
                "reads `(4, 1, T)` position_ids as packed: row 0 plain text positions, rows 1-3 the rotary positions",
                "modeling/vision.py",
                source={
                    f"transformers.models.{family}ThinkerTextModel.forward": (
                        "if position_ids.ndim == 3 and position_ids.shape[0] == 4:",
                        "text_position_ids = position_ids[0]",
                    )
                },
            ),
        )
    ),
    Seam(
        "transformers",
        "transformers.PreTrainedModel.set_attn_implementation",
        "switches the policy, the reference and the twins to the packed attention; a multimodal model's language "
        "model alone, given `{text sub-config key: backend}`",
        "integrations/transformers.py",
        parameters=("self", "attn_implementation"),
        source={"transformers.PreTrainedModel.set_attn_implementation": ("isinstance(attn_implementation, dict)",)},
    ),
    Seam(
        "transformers",
        "transformers.PretrainedConfig.get_text_config",
        "the language model's config of a multimodal config (itself for a text model), found among `sub_configs`",
        "integrations/transformers.py",
        check=Check("callable", callable),
    ),
    Seam(
        "transformers",
        "transformers.models.gemma3.modeling_gemma3.get_block_sequence_ids_for_mask",
        "Gemma 3 lets an image's tokens (token_type_ids == 1) attend to the whole image: padfree_varlen carries those "
        "spans in the packed row (attention/bidirectional.py)",
        "modeling/vision.py",
        parameters=("token_type_ids",),
        source={
            "transformers.models.gemma3.modeling_gemma3.get_block_sequence_ids_for_mask": ("token_type_ids == 1",)
        },
    ),
]

TRANSFORMERS = [
    Seam(
        "trl", "trl.trainer.dpo_trainer.DataCollatorForVisionPreference (templating)",
        "a pair counted from its image sizes is templated and tokenized as the collator does it: these three "
        "functions of its module, the prompt tokenized apart from each completion without special tokens",
        "integrations/trl.py, packing/pair_sizes.py", where=VISION_COLLATE,
        source={
            VISION_COLLATE: (
                'example["prompt"] = prepare_multimodal_messages(example["prompt"], images=example["images"])',
                "examples = [apply_chat_template(example, self.processor) for example in examples]",
                "add_special_tokens=False",
                "input_ids = torch.cat((prompt_ids, completion_ids), dim=1)",
            )
        },
        ordered=True,
    ),
    *(
        Seam(
            "transformers", f"transformers.models.{module}.processing_{module}.{name}._get_num_multimodal_tokens",
            "each image's placeholder tokens from its (height, width), and `replace_image_token` writing the "
            "placeholder that many times: a vision pair's row counted without image processing",
            "integrations/transformers.py, packing/pair_sizes.py", check=Check("callable", callable),
            source={
                f"transformers.models.{module}.processing_{module}.{name}.replace_image_token": (
                    "return self.image_token * num_image_tokens",
                )
            },
        )
        for module, name in (
            ("qwen2_vl", "Qwen2VLProcessor"),
            ("qwen2_5_vl", "Qwen2_5_VLProcessor"),
            ("qwen3_vl", "Qwen3VLProcessor"),
            ("llava", "LlavaProcessor"),
        )
    ),
    Seam(
        "transformers", "transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback",
        "the decorator of every mixer kernel: its wrappers' closures say what a call runs (integrations.transformers.kernel_wrapper, "
        "tests/integrations/test_seams.py::test_transformers_kernel_wrappers_hold_what_they_resolved), read through the `kernels` "
        "function module it returns where `kernels` is installed (its class's `forward` closure `func`, "
        "`kernel_layer_name`) and the model module's own helpers; `_PACKAGE_SUPPORTED_DEVICES` (>= 5.25), left out "
        "when the stand-ins rebuild them with it; a layer's `_kernel_funcs`, where `kernelize` puts hub kernels",
        "integrations/transformers.py, modeling/kernels/mixers.py", parameters=("func_name", "package"),
    ),
    Seam(
        "transformers", "transformers.Trainer.get_train_dataloader", "overridden (token-budget and split-row loaders)",
        "trainer.py", parameters=("self",),
    ),
    Seam(
        "transformers", "transformers.Trainer.get_batch_samples",
        "overridden to count an optimizer step's pairs and start its clock (padfree/tokens_per_second); returns "
        "(batch_samples, num_items_in_batch)",
        "trainer.py", parameters=("self", "epoch_iterator", "num_batches", "device"),
        source={"transformers.Trainer.get_batch_samples": ("return batch_samples, num_items_in_batch",)},
    ),
    Seam(
        "transformers", "transformers.Trainer._remove_unused_columns",
        "private: the Trainer's column filtering, reused for the token-budget dataloader", "integrations/trl.py",
        parameters=("self", "dataset"), keywords=("description",),
    ),
    Seam(
        "transformers", "transformers.Trainer._prepare_inputs",
        "private: moves a batch to the device before it is unpacked in `prediction_step`", "integrations/trl.py",
        parameters=("self", "inputs"),
    ),
    Seam(
        "transformers", "transformers.Trainer.training_step", "called positionally by the benchmark",
        "cli/bench/harness.py", parameters=("self", "model", "inputs"),
    ),
    Seam(
        "transformers", "transformers.Trainer.current_gradient_accumulation_steps",
        "set by the training loop; token-budget micro-batches are weighed by it (the benchmark sets it itself)",
        "trainer.py, cli/bench/harness.py", where="transformers.Trainer._run_epoch",
        source={"transformers.Trainer._run_epoch": ("self.current_gradient_accumulation_steps =",)},
    ),
    Seam(
        "transformers", "transformers.TrainingArguments.fsdp_plugin_args",
        "set by `__post_init__` for an `fsdp` run: its `fsdp_version` is read before the Accelerator exists",
        "placement/fsdp2.py", where="transformers.TrainingArguments.__post_init__",
        source={
            "transformers.TrainingArguments.__post_init__": ("self.fsdp_plugin_args = self._process_fsdp_args()",)
        },
    ),
    Seam(
        "transformers", "transformers.trainer_utils.seed_worker",
        "the Trainer's dataloader worker seeding, given `num_workers` and `rank` by name", "features/pair_weighted_steps.py",
        parameters=("worker_id",), keywords=("num_workers", "rank"),
    ),
    Seam(
        "transformers", "transformers.AttentionInterface.register", "registers `padfree_varlen`", "integrations/transformers.py, modeling/attention/__init__.py",
        parameters=("cls", "key", "value"),
    ),
    Seam(
        "transformers", "transformers.masking_utils.AttentionMaskInterface.register",
        "registers `padfree_varlen`'s mask function, which reads the padding mask by keyword", "integrations/transformers.py, modeling/attention/__init__.py",
        parameters=("cls", "key", "value"),
        source={"transformers.masking_utils.create_causal_mask": ("attention_mask=attention_mask,",)},
    ),
    Seam(
        "transformers", "transformers.integrations.sdpa_attention.sdpa_attention_forward",
        "the attention interface's calling convention, which `padfree_varlen_attention` implements", "modeling/attention/interface.py",
        parameters=("module", "query", "key", "value", "attention_mask"), keywords=("dropout", "scaling"),
    ),
    Seam(
        "transformers", "transformers.modeling_flash_attention_utils.FlashAttentionKwargs",
        "the packing keywords transformers passes down to attention, as the collator names them",
        "packing/collator.py, modeling/packed_forward.py, modeling/attention/interface.py",
        check=has_keys("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"),
    ),
    Seam(
        "transformers", "transformers.masking_utils.find_packed_sequence_indices",
        "sdpa and eager keep packed sequences apart from `position_ids` when no attention mask is passed",
        "modeling/check/packability.py, modeling/packed_forward.py", parameters=("position_ids",),
    ),
    Seam(
        "transformers", "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS",
        "the registry the modeling code looks attention up in, holding the backends checks.py names; the "
        "architecture check swaps an entry to count calls",
        "integrations/transformers.py, modeling/check/packability.py",
        check=Check(
            f"an AttentionInterface holding {[*FLASH_VARLEN, 'sdpa']}",
            lambda registry: isinstance(registry, resolve("transformers.AttentionInterface"))
            and all(name in registry for name in (*FLASH_VARLEN, "sdpa")),
        ),
    ),
    Seam(
        "transformers", "transformers.masking_utils.AttentionMaskInterface._global_mapping",
        "private: the registry of mask functions `create_causal_mask` checks before anything else; a backend not in it "
        "gets no mask and no packed-sequence detection (a host read per forward). A packed forward on `padfree_varlen` "
        "takes its entry out while it runs",
        "integrations/transformers.py",
        check=Check("a dict holding 'sdpa'", lambda mapping: isinstance(mapping, dict) and "sdpa" in mapping),
        source={
            "transformers.masking_utils._preprocess_mask_arguments": (
                "if config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:",
                "return True, None, None, None, None, None, None",
            ),
            "transformers.masking_utils.create_causal_mask": ("if early_exit:",),
        },
    ),
    Seam(
        "transformers", "transformers.configuration_utils.ALLOWED_LAYER_TYPES",
        f"`{CHUNKED_LAYER_TYPE}` is the layer type of chunked attention layers (llama4), cut into chunks by "
        "`padfree_varlen`", "modeling/attention/interface.py",
        check=Check(f"containing {CHUNKED_LAYER_TYPE!r}", lambda types: CHUNKED_LAYER_TYPE in types),
    ),
    Seam(
        "transformers", "transformers.PretrainedConfig._attn_implementation",
        "private: the attention a model runs, read everywhere and set on the twin's config (no public getter)",
        "integrations/transformers.py", check=is_property(),
    ),
    Seam(
        "transformers", "transformers.PretrainedConfig._experts_implementation",
        "private: set to eager on the float64 twin's config", "integrations/transformers.py", check=is_property(),
    ),
    Seam(
        "transformers", "transformers.PreTrainedModel.base_model",
        "resolves `base_model_prefix`, which fused_lm_head.py sets on instances whose `base_model` is themselves",
        "modeling/fused_lm_head.py", check=instance_of(property),
        source={"transformers.PreTrainedModel.base_model": ("getattr(self, self.base_model_prefix, self)",)},
    ),
    Seam(
        "transformers", "transformers.PreTrainedModel._no_split_modules",
        "private: the classes accelerate's TRANSFORMER_BASED_WRAP gives an FSDP unit each", "integrations/transformers.py",
        source={"accelerate.utils.fsdp_utils.fsdp2_prepare_auto_wrap_policy": ("_no_split_modules",)},
    ),
    Seam(
        "transformers", "transformers.integrations.deepspeed._hf_deepspeed_config_weak_ref",
        "private module global: the ZeRO-3 config `from_pretrained` builds under, saved and restored around "
        "building the offloaded reference's config",
        "integrations/transformers.py",
        source={"transformers.integrations.deepspeed.set_hf_deepspeed_config": ("_hf_deepspeed_config_weak_ref = ",)},
    ),
    Seam(
        "transformers", "transformers.integrations.deepspeed.set_hf_deepspeed_config", "restores the saved config",
        "integrations/transformers.py, placement/deepspeed.py", parameters=("hf_deepspeed_config_obj",),
    ),
    Seam(
        "transformers", "transformers.integrations.deepspeed.unset_hf_deepspeed_config",
        "builds models unpartitioned", "placement/deepspeed.py, sources.py",
    ),
    Seam(
        "transformers", "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_process",
        "fills the reference config's 'auto' values from the training arguments", "placement/deepspeed.py",
        parameters=("self", "args"),
    ),
    Seam(
        "transformers", "transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
        "the model types `trl-padfree models` checks (less the masked-LM, seq2seq and speech seq2seq mappings)",
        "integrations/transformers.py, cli/models.py", check=instance_of("collections.abc.Mapping"),
    ),
    Seam(
        "transformers", "transformers.models.auto.modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
        "encoder-decoder types left out of `trl-padfree models`", "integrations/transformers.py, cli/models.py",
        check=instance_of("collections.abc.Mapping"),
    ),
    Seam(
        "transformers", "transformers.models.auto.modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES",
        "encoder types left out of `trl-padfree models`", "integrations/transformers.py, cli/models.py", check=instance_of("collections.abc.Mapping"),
    ),
    Seam(
        "transformers", "transformers.models.auto.modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
        "speech seq2seq types left out of `trl-padfree models`", "integrations/transformers.py, cli/models.py",
        check=instance_of("collections.abc.Mapping"),
    ),
    Seam(
        "transformers", "transformers.models.auto.modeling_auto.MODEL_MAPPING_NAMES",
        "a vision-language type's inner model class, whose `get_rope_index` says whether its twin gets mRoPE sections",
        "integrations/transformers.py, modeling/check/family_twins.py", check=instance_of("collections.abc.Mapping"),
    ),
]  # fmt: skip

ACCELERATE = [
    Seam(
        "accelerate", "accelerate.Accelerator.deepspeed_ulysses_dl_adapter",
        "replaced on the trainer's Accelerator (whole packed batches on every rank of a Ulysses group); the Trainer "
        "calls it with (dataloader, model)",
        "features/row_split.py", parameters=("self", "dl", "model"),
        source={"transformers.Trainer._prepare_for_training": ("self.accelerator.deepspeed_ulysses_dl_adapter(",)},
    ),
    Seam(
        "accelerate", "accelerate.Accelerator.gather",
        "replaced on the instance around TRL's loss (token budget: per-process lengths differ); TRL looks it up at "
        "call time",
        "integrations/accelerate.py, features/pair_weighted_steps.py", parameters=("self", "tensor"),
        source={COMPUTE_LOSS: ("self.accelerator.gather(", "self.accelerator.gather_for_metrics(")},
    ),
    Seam(
        "accelerate", "accelerate.Accelerator.pad_across_processes", "pads per-pair tensors before gathering",
        "integrations/accelerate.py", parameters=("self", "tensor"), keywords=("dim",),
    ),
    Seam(
        "accelerate", "accelerate.Accelerator.reduce", "sums pair counts over processes", "features/pair_weighted_steps.py",
        parameters=("self", "tensor", "reduction"),
    ),
    Seam(
        "accelerate", "accelerate.parallelism_config.ParallelismConfig",
        "built for sequence_parallel_size; `cp_size` refused, `dp_shard_size` set to the data-parallel ranks, the "
        "FSDP mesh dimensions read",
        "config.py, features/row_split.py, parallel/ulysses.py, placement/fsdp2.py",
        keywords=("sp_backend", "sp_size", "sp_handler", "cp_size", "dp_shard_size"),
        check=has_attributes("fsdp_dim_names"),
    ),
    Seam(
        "accelerate", "accelerate.utils.DeepSpeedSequenceParallelConfig",
        "its `sp_attn_implementation` is replaced by the model's packing-aware attention, which accelerate hands "
        "to DeepSpeed Ulysses at prepare time",
        "config.py", keywords=("sp_seq_length_is_variable", "sp_attn_implementation"),
        source={
            "accelerate.Accelerator._prepare_deepspeed": (
                "core_attn_implementation=sp_handler.sp_attn_implementation",
            )
        },
    ),
    Seam(
        "accelerate", "accelerate.utils.fsdp_utils.fsdp2_prepare_auto_wrap_policy",
        "not exported from accelerate.utils: the policy's FSDP2 units, reused to shard the reference", "placement/fsdp2.py",
        parameters=("fsdp2_plugin", "model"),
    ),
    Seam(
        "accelerate", "accelerate.utils.FullyShardedDataParallelPlugin", "read to shard the reference like the policy",
        "placement/fsdp2.py", keywords=("fsdp_version", "cpu_offload", "mixed_precision_policy"),
    ),
    Seam(
        "accelerate", "accelerate.utils.DataLoaderConfiguration",
        "`dispatch_batches` refused and set to False, `split_batches` refused", "trainer.py",
        keywords=("dispatch_batches", "split_batches"),
    ),
    Seam(
        "accelerate", "accelerate.utils.DeepSpeedPlugin", "the policy's DeepSpeed config and ZeRO stage",
        "placement/deepspeed.py, trainer.py", keywords=("zero_stage",),
        source={"accelerate.utils.DeepSpeedPlugin.__post_init__": ("self.deepspeed_config = ",)},
    ),
    Seam(
        "accelerate", "accelerate.utils.launch.prepare_multi_gpu_env",
        "`accelerate launch` marks an FSDP config in these variables, read before the Accelerator exists", "placement/fsdp2.py",
        source={
            "accelerate.utils.launch.prepare_multi_gpu_env": (
                'current_env["ACCELERATE_USE_FSDP"]',
                'current_env["FSDP_VERSION"]',
            )
        },
    ),
    Seam(
        "accelerate", "accelerate.utils.launch.prepare_extend_env_parallelism_config",
        "`accelerate launch` passes a config file's parallelism_config on in these variables", "config.py",
        source={
            "accelerate.utils.launch.prepare_extend_env_parallelism_config": (
                'current_env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"',
            ),
            "accelerate.parallelism_config.ParallelismConfig": (
                'os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")',
                'os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")',
            ),
        },
    ),
]  # fmt: skip

PARALLEL_STATE_SP = "deepspeed.runtime.sequence_parallel.parallel_state_sp"
REGISTER_ULYSSES = "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF.register_with_transformers"

DEEPSPEED = [
    Seam(
        "deepspeed", f"{PARALLEL_STATE_SP}.get_sequence_parallel_group",
        "the Ulysses group (with `_rank` and `_world_size` below): the module Ulysses' registration initializes "
        "and returns as the `mpu` accelerate hands DeepSpeed",
        "integrations/deepspeed.py, parallel/ulysses.py",
        source={
            REGISTER_ULYSSES: ("import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu", "return mpu")
        },
    ),
    Seam("deepspeed", f"{PARALLEL_STATE_SP}.get_sequence_parallel_rank", "this rank in it", "integrations/deepspeed.py, parallel/ulysses.py"),
    Seam(
        "deepspeed", f"{PARALLEL_STATE_SP}.get_sequence_parallel_world_size", "its size", "integrations/deepspeed.py, parallel/ulysses.py"),
    Seam(
        "deepspeed", f"{PARALLEL_STATE_SP}._SEQUENCE_PARALLEL_GROUP",
        "private module global, read to refuse a second sequence-parallel trainer in one process (DeepSpeed asserts "
        "it is unset when it creates the groups)",
        "integrations/deepspeed.py",
        source={f"{PARALLEL_STATE_SP}.initialize_sequence_parallel": ("assert _SEQUENCE_PARALLEL_GROUP is None",)},
    ),
    Seam(
        "deepspeed", "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF.register_with_transformers",
        "wraps whichever registered attention the model runs (`core_attn_implementation`), and only in training mode "
        "(`disable_in_eval`): the reference runs in training mode under Ulysses",
        "trainer.py, modeling/packed_forward.py", keywords=("core_attn_implementation", "seq_length_is_variable", "disable_in_eval"),
    ),
    Seam(
        "deepspeed", "deepspeed.initialize", "wraps the offloaded reference in its own engine", "placement/deepspeed.py",
        keywords=("model", "config"),
    ),
    Seam(
        "deepspeed", "deepspeed.runtime.engine.DeepSpeedEngine.zero_offload_param",
        "the engine's parameter offload settings (`.device`): the reference is checked to be offloaded", "placement/deepspeed.py",
        parameters=("self",),
    ),
    Seam(
        "deepspeed", "deepspeed.runtime.zero.partition_parameters",
        "a ZeRO-3 parameter's shard is its `ds_tensor`: the reference's shards are checked to be in CPU memory",
        "placement/deepspeed.py", source={"deepspeed.runtime.zero.partition_parameters": ("param.ds_tensor = ",)},
    ),
    Seam(
        "deepspeed", "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs",
        "DeepSpeed's ZeRO-3 estimator, called by keyword", "plan/memory.py",
        keywords=(
            "total_params", "largest_layer_params", "num_gpus_per_node", "num_nodes", "cpu_offload",
            "cpu_offload_params", "zero_init",
        ),
    ),
    Seam(
        "deepspeed", "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs",
        "DeepSpeed's ZeRO-2 estimator, called by keyword", "plan/memory.py",
        keywords=("total_params", "num_gpus_per_node", "num_nodes", "cpu_offload"),
    ),
]  # fmt: skip

TORCH = [
    Seam(
        "torch", "torch.distributed.fsdp.fully_shard", "shards the reference, one unit per decoder layer", "placement/fsdp2.py",
        parameters=("module",), keywords=("mesh", "reshard_after_forward", "mp_policy", "offload_policy"),
    ),
    Seam(
        "torch", "torch.distributed.fsdp.CPUOffloadPolicy", "ref_offload under FSDP2", "placement/fsdp2.py",
        keywords=("pin_memory",),
    ),
    Seam(
        "torch", "torch.distributed.fsdp.MixedPrecisionPolicy", "the reference's default precision policy", "placement/fsdp2.py"
    ),
    Seam("torch", "torch.distributed.fsdp.FSDPModule", "recognizes a reference already sharded", "placement/fsdp2.py"),
    Seam(
        "torch", "torch._dynamo.eval_frame.OptimizedModule",
        "the wrapper `torch.compile(module)` returns, which accelerate puts around the models it prepares under "
        "`torch_compile=True`: the architecture check judges the class under it",
        "integrations/torch.py, modeling/check/packability.py", check=instance_of(type),
    ),
    Seam(
        "torch", "torch._dynamo.eval_frame.OptimizedModule._orig_mod",
        "the module under the compiled wrapper, an instance attribute",
        "integrations/torch.py, modeling/check/packability.py", where="torch._dynamo.eval_frame.OptimizedModule.__init__",
        source={"torch._dynamo.eval_frame.OptimizedModule.__init__": ("self._orig_mod = mod",)},
    ),
    Seam(
        "torch", "torch.nn.attention.varlen.varlen_attn",
        "PyTorch's varlen flash attention: its seven leading arguments passed by position; the keywords after them "
        "are read from its signature at run time (attention.varlen_kernel_plan)",
        "modeling/kernels/attention.py, modeling/attention/varlen.py",
        parameters=("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"),
    ),
    Seam(
        "torch", "torch.nn.attention.sdpa_kernel",
        "chooses varlen_attn's Flash backend around each call (torch >= 2.15 reads these flags, picking cuDNN first)",
        "modeling/kernels/attention.py", parameters=("backends",),
    ),
    Seam(
        "torch", "torch.nn.attention.SDPBackend.FLASH_ATTENTION", "the backend chosen for varlen_attn", "modeling/kernels/attention.py",
    ),
    Seam(
        "torch", "torch.nn.attention.flex_attention.BlockMask.from_kv_blocks",
        "the softcap layers' block mask from the row's host tiles, no T x T mask (attention/fused.py DocumentTiles)",
        "modeling/kernels/attention.py, modeling/attention/fused.py",
        parameters=("cls", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"),
        keywords=("BLOCK_SIZE", "mask_mod", "seq_lengths"),
    ),
    Seam(
        "torch", "torch._dynamo.exc.FailOnRecompileLimitHit",
        "raised where the compiled FlexAttention would pass the recompile limit and run unfused", "integrations/torch.py",
        check=instance_of(type),
    ),
    Seam(
        "torch", "torch._dynamo.config.recompile_limit", "named in the refusal past it", "integrations/torch.py",
        check=instance_of(int),
    ),
    Seam(
        "torch", "torch.ops.aten._efficient_attention_backward",
        "called eagerly inside trl_padfree::efficient_attention's backward (the wide-head op), with `cu_seqlens`",
        "integrations/torch.py",
        check=Check(
            "a schema with cu_seqlens_q and custom_mask_type",
            lambda op: {"cu_seqlens_q", "custom_mask_type"} <= {a.name for a in op.default._schema.arguments},
        ),
    ),
    Seam(
        "torch", "torch.nn.functional.scaled_dot_product_attention",
        "per-segment attention, with `scale` and `enable_gqa` by keyword", "modeling/attention/segments.py",
        check=Check(  # a builtin: no inspect.signature, its docstring opens with the signature
            "a docstring signature with `scale` and `enable_gqa`",
            lambda function: "scale=" in function.__doc__ and "enable_gqa=" in function.__doc__,
        ),
    ),
]  # fmt: skip

PEFT = [
    Seam(
        "peft", "peft.PeftModel.active_adapter", "`peft_config[active_adapter]` is the adapter trained",
        "features/padding_free.py", where="peft.PeftModel.__init__",
        source={"peft.PeftModel.__init__": ("self.active_adapter = adapter_name",)},
    ),
    Seam("peft", "peft.PeftModel.get_base_model", "the model under the adapter", "features/padding_free.py, modeling/fused_lm_head.py, features/row_split.py", parameters=("self",)),
    Seam(
        "peft", "peft.PeftConfig.is_prompt_learning", "prompt-learning adapters are refused", "refusals/models.py, features/padding_free.py",
        check=instance_of(property),
    ),
]  # fmt: skip

DATASETS = [
    Seam(
        "datasets", "datasets.packaged_modules.json.json.JsonConfig.chunksize",
        "the bytes of a JSON file datasets reads to fix its columns' types, later rows cast to them (sources.py "
        "re-reads a longer file to find a row the cast would hide)", "integrations/datasets.py", check=instance_of(int),
    ),
]  # fmt: skip

SEAMS = TRL + TRANSFORMERS + TRANSFORMERS_VISION + ACCELERATE + DEEPSPEED + TORCH + PEFT + DATASETS


# ---- checks ----


def resolve(dotted: str) -> Any:
    """The object `dotted` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name) and cut > 1:
                continue  # not a module: an attribute of a shorter prefix
            raise
        for depth, attribute in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attribute):
                raise AttributeError(f"`{'.'.join(parts[:depth])}` has no attribute `{attribute}`")
            obj = inspect.getattr_static(obj, attribute) if inspect.isclass(obj) else getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


def _callable_of(obj):
    # A property's getter, a staticmethod's or classmethod's function: what signature and source are read from
    if isinstance(obj, property):
        return obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    return obj


def _source(dotted: str) -> str:
    return inspect.getsource(_callable_of(resolve(dotted)))


def problems(seam: Seam) -> list[str]:
    """What no longer holds of `seam` in the installed libraries (empty when all holds)."""
    found = []
    try:
        obj = resolve(seam.where or seam.name)
    except (ImportError, AttributeError) as error:
        return [f"does not resolve ({error})"]
    if seam.parameters or seam.keywords:
        try:
            names = list(inspect.signature(_callable_of(obj)).parameters)
        except (TypeError, ValueError) as error:
            return [f"has no readable signature ({error})"]
        leading = names[: len(seam.parameters)]
        if leading != list(seam.parameters):
            found.append(f"parameters start {leading}, trl-padfree passes {list(seam.parameters)}")
        missing = [name for name in seam.keywords if name not in names]
        if missing:
            found.append(f"has no parameter(s) {missing} (signature: {names})")
    if seam.check is not None and not seam.check.holds(obj):
        found.append(f"is not {seam.check.expects}: got {obj!r}"[:300])
    for target, snippets in seam.source.items():
        try:
            source = _source(target)
        except (ImportError, AttributeError, OSError, TypeError) as error:
            found.append(f"cannot read the source of `{target}` ({error})")
            continue
        source = re.sub(r"\s+", " ", source)  # formatting changes are not seams
        position = 0
        for snippet in snippets:
            at = source.find(re.sub(r"\s+", " ", snippet), position if seam.ordered else 0)
            if at < 0:
                found.append(
                    f"`{target}` no longer contains `{snippet}`" + (" (in this order)" if seam.ordered else "")
                )
            elif seam.ordered:
                position = at
    return found


@pytest.mark.parametrize("seam", SEAMS, ids=[seam.id for seam in SEAMS])
def test_seam(seam: Seam):
    if seam.library == "deepspeed":
        pytest.importorskip("deepspeed")
    found = problems(seam)
    if found:
        used_in = ", ".join(f"trl_padfree/{module.strip()}" for module in seam.used_in.split(","))
        pytest.fail(
            f"{seam.library} `{seam.name}` (used by {used_in}) "
            + "; ".join(found)
            + f". trl-padfree relies on: {seam.relied_on}",
            pytrace=False,
        )


def test_every_seam_is_listed_once():
    ids = [seam.id for seam in SEAMS]
    assert len(ids) == len(set(ids)), sorted({id_ for id_ in ids if ids.count(id_) > 1})


def _used_in(seam: Seam) -> list[str]:
    return [module.strip() for module in seam.used_in.split(",")]


def test_every_seam_names_modules_that_exist():
    package = Path(__file__).resolve().parents[2] / "trl_padfree"
    missing = [
        f"{seam.name}: {module}" for seam in SEAMS for module in _used_in(seam) if not (package / module).is_file()
    ]
    assert not missing, missing


def test_private_seams_are_named_only_under_integrations():
    """A private name of TRL, transformers, accelerate or DeepSpeed is read or written in integrations/ alone (the
    rest of the package goes through the functions there), and the table says where."""
    package = Path(__file__).resolve().parents[2] / "trl_padfree"
    sources = {str(path.relative_to(package)): path.read_text() for path in package.rglob("*.py")}
    wrong = []
    for seam in SEAMS:
        name = seam.name.rsplit(".", 1)[-1]
        if not name.startswith("_") or name.startswith("__"):
            continue
        code = {
            module for module, text in sources.items() if re.search(rf"(?<![\w`])\.?{name}\b(?!`)", _code_only(text))
        }
        if any(not module.startswith("integrations/") for module in code):
            wrong.append(f"{seam.name} named outside integrations/: {sorted(code)}")
        if code - set(_used_in(seam)):
            wrong.append(f"{seam.name} named in {sorted(code - set(_used_in(seam)))}, not in its used_in")
    assert not wrong, wrong


def _code_only(text: str) -> str:
    """`text` without comments and docstrings (a module may explain a private name it does not touch)."""
    tree = ast.parse(text)
    lines = text.splitlines()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            for line in range(body[0].lineno - 1, body[0].end_lineno):
                lines[line] = ""
    return "\n".join(line.split("#", 1)[0] for line in lines)


# ---- trl-padfree's own names on the subclass ----

# TRL's and the Trainer's methods trl-padfree's DPOTrainer overrides on purpose, each a seam of the table above
OVERRIDDEN = {
    "__init__",
    "_tag_names",
    "_precompute_ref_logps",
    "compute_ref_log_probs",
    "compute_loss",
    "prediction_step",
    "log",
    "create_model_card",
    "get_train_dataloader",
    "get_batch_samples",
}


def _instance_attributes(cls: type) -> set[str]:
    """The `self.<name> =` assignments in the source of `cls`."""
    return set(re.findall(r"self\.([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=)", inspect.getsource(cls)))


def test_subclass_overrides_only_the_listed_seams():
    """A name trl-padfree's DPOTrainer defines that TRL or the Trainer also defines must be a deliberate override
    (listed above, and in the table); a TRL release that adds a method or attribute of the same name would otherwise
    be shadowed, or shadow ours, without a sound."""
    import trl

    from trl_padfree import DPOTrainer

    ours = set(vars(DPOTrainer)) | _instance_attributes(DPOTrainer)
    ours -= {"__module__", "__doc__", "__qualname__", "__firstlineno__", "__static_attributes__", "__annotations__"}
    theirs = {name for cls in trl.DPOTrainer.__mro__ if cls is not object for name in vars(cls)}
    for cls in trl.DPOTrainer.__mro__:
        if cls.__module__.startswith(("trl", "transformers")):
            theirs |= _instance_attributes(cls)
    # Attributes of TRL's that trl-padfree writes on purpose (seams of the table above)
    written = {"_tp_size", "data_collator", "ref_model"}
    shared = sorted(ours & theirs - OVERRIDDEN - written)
    assert not shared, f"trl-padfree's DPOTrainer and TRL/transformers' both define {shared}: rename ours"
    in_table = {seam.name.rsplit(".", 1)[-1] for seam in SEAMS if seam.library in ("trl", "transformers")}
    assert not OVERRIDDEN - in_table, f"overrides missing from the table: {sorted(OVERRIDDEN - in_table)}"


# ---- the fused LM head's output layout ----


def test_trl_fused_lm_head_returns_the_layout_the_packed_forward_maps():
    """forward.py maps the head's per-token outputs back by shape: `(rows, len - 1)` with `labels` (TRL shifts them),
    `(rows, len)` with pre-shifted `shift_labels` (a split row's chunk), zero where the label is -100."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from trl_padfree.tiny import make_model

    model = make_model("llama", num_hidden_layers=1)
    add_fused_lm_head(model)
    input_ids = torch.randint(4, 90, (1, 7))
    labels = input_ids.masked_fill(torch.arange(7) < 2, -100)
    with torch.no_grad():
        shifted = model(input_ids=input_ids, labels=labels, fused_lm_head=True).log_probs
        unshifted = model(input_ids=input_ids, shift_labels=labels, fused_lm_head=True).log_probs
    assert shifted.shape == (1, 6) and unshifted.shape == (1, 7)
    assert (shifted[0, :1] == 0).all() and (shifted[0, 1:] < 0).all()
    assert (unshifted[0, :2] == 0).all() and (unshifted[0, 2:] < 0).all()


# ---- transformers' mixer kernel wrappers (kernels.py) ----


def test_mixer_kernel_names_are_transformers_kernel_hub_names():
    """kernels.py knows each whole-row mixer kernel's boundary argument by the name transformers' kernel hub gives it;
    a renamed kernel would run per segment (still exact, slower). Read from the modeling files (seconds)."""
    import pathlib

    import transformers

    from trl_padfree.modeling.kernels.mixers import BOUNDARY_ARGUMENTS, DECODE_ONLY_KERNELS

    named = set()
    for path in (pathlib.Path(transformers.__file__).parent / "models").glob("*/modeling_*.py"):
        named.update(re.findall(r'use_kernel_func_from_hub_with_fallback\("(\w+)"', path.read_text()))
    missing = sorted((set(BOUNDARY_ARGUMENTS) | DECODE_ONLY_KERNELS) - named)
    assert not missing, (
        f"no transformers model uses the kernels {missing} any more (trl_padfree/modeling/kernels/mixers.py)"
    )


def test_transformers_kernel_wrappers_hold_what_they_resolved():
    """integrations.transformers.kernel_wrapper reads a wrapper's closure (`implementation`, `is_new_implementation`, `func_name`,
    `package`, `torch_function`); the stand-ins rebuild wrappers with transformers' own decorator, which passes on
    only the keywords the implementation names."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    from trl_padfree.integrations.transformers import kernel_wrapper

    def fallback(x, weight, bias=None, activation=None, **kwargs):
        return ("fallback", sorted(kwargs))

    wrapper = use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "no_such_kernel_package")(fallback)
    resolved = kernel_wrapper(wrapper)
    assert resolved is not None, "transformers' kernel wrapper no longer holds what it resolved in its closure"
    assert (resolved.name, resolved.package, resolved.implementation, resolved.is_fallback) == (
        "causal_conv1d_fn", "no_such_kernel_package", fallback, True,
    )  # fmt: skip
    assert wrapper(1, 2, unknown=3) == ("fallback", [])  # keywords the implementation does not name are dropped


def test_rebuilt_kernel_wrappers_run_the_given_function_on_any_device():
    """The stand-ins' wrappers (integrations.transformers.rewrapped) run the function they were given on CPU inputs
    too: transformers >= 5.25 hands a package's kernel only inputs on the devices it lists for the package
    (`_PACKAGE_SUPPORTED_DEVICES`, CUDA for causal-conv1d), which the rebuild leaves out."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    from trl_padfree.integrations.transformers import kernel_wrapper, rewrapped

    def fallback(x, weight, bias=None, activation=None, **kwargs):
        return "fallback"

    def stand_in(x, weight, bias=None, seq_idx=None, activation=None):
        return ("stand-in", seq_idx)

    wrapper = use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")(fallback)
    rebuilt = rewrapped(wrapper, stand_in)

    assert rebuilt(torch.zeros(1), None, seq_idx=3) == ("stand-in", 3)
    assert kernel_wrapper(rebuilt).runs_on("cpu") and kernel_wrapper(rebuilt).runs_on("cuda")
    assert kernel_wrapper(wrapper).is_fallback  # the original is untouched
