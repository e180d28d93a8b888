"""TRL's private names trl-padfree relies on (TRL >=1.16,<1.17, _compat.py; tests/integrations/test_seams.py checks each):

- `TRLSeams`, the base of trl-padfree's `DPOTrainer`: the private methods and attributes of TRL's `DPOTrainer` (and of
  transformers' `Trainer` under it) it overrides or reads, each behind a public name;
- the module-level names of `trl.trainer.dpo_trainer` that trl-padfree reroutes while TRL's `__init__` runs (the fused
  LM head, the reference's DeepSpeed and FSDP preparation), swapped by `integrations.swapped`, which fails loudly if
  TRL stops going through them;
- the tile sizes of TRL's fused LM head, for the memory planner;
- the templating `DataCollatorForVisionPreference` runs on each example (`trl.data_utils`, read from the collator's
  module so that a pair counted from its image sizes is templated by the same functions: packing/pair_sizes.py);
- what TRL's `trl dpo` script does with `--ignore_bias_buffers` (torch DDP's list of buffers to leave alone).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import trl
import trl.trainer.dpo_trainer as trl_dpo_trainer
from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE as LOGITS_TILE_TOKENS
from trl.trainer.dpo_trainer import DataCollatorForPreference, DataCollatorForVisionPreference
from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as LOGITS_TILE_VOCAB
from trl.trainer.utils import create_model_from_path, get_config_model_id

from . import swapped

# The templating DataCollatorForVisionPreference.torch_call runs, as that module names it
apply_chat_template = trl_dpo_trainer.apply_chat_template
is_conversational = trl_dpo_trainer.is_conversational
prepare_multimodal_messages = trl_dpo_trainer.prepare_multimodal_messages

__all__ = [
    "LOGITS_TILE_TOKENS",
    "LOGITS_TILE_VOCAB",
    "DataCollatorForPreference",
    "DataCollatorForVisionPreference",
    "TRLSeams",
    "apply_chat_template",
    "bound_init_arguments",
    "create_model_from_path",
    "fused_lm_head_added_with",
    "get_config_model_id",
    "ignore_boolean_buffers_in_ddp",
    "is_conversational",
    "padding_free_hidden",
    "prepare_multimodal_messages",
    "reference_deepspeed_prepared_with",
    "reference_fsdp_prepared_with",
]


class TRLSeams(trl.DPOTrainer):
    """TRL's `DPOTrainer` with its private parts behind public names, for trl-padfree's subclass to build on."""

    _tag_names = [*trl.DPOTrainer._tag_names, "trl-padfree"]

    def before_reference_precompute(self) -> None:
        """Called before TRL precomputes reference log-probs, which it does inside its own `__init__`."""

    def _precompute_ref_logps(self, dataset, name, batch_size):
        self.before_reference_precompute()
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def logged_metrics(self, mode: str) -> dict[str, list[float]]:
        """TRL's metric lists of `mode` ("train" or "eval"), averaged at each log."""
        return self._metrics[mode]

    def count_tokens_once_per(self, ranks: int) -> None:
        """Every rank of a group computes the same batch's metrics: count its tokens once (TRL's own correction for
        tensor parallelism)."""
        self._tp_size *= ranks

    @property
    def is_vision_dataset(self) -> bool:
        return self._is_vision_dataset

    def columns_the_model_takes(self, dataset, description: str):
        """The Trainer's removal of the columns the model does not take, as its dataloaders apply it."""
        return self._remove_unused_columns(dataset, description=description)

    def on_device(self, inputs: dict) -> dict:
        """The Trainer's preparation of a batch (moved to the device), as `training_step` applies it."""
        return self._prepare_inputs(inputs)


def bound_init_arguments(*args, **kwargs) -> dict:
    """The arguments `trl.DPOTrainer.__init__` receives, by name, however they were passed (those left out absent)."""
    bound = inspect.signature(trl.DPOTrainer.__init__).bind(None, *args, **kwargs)
    return {name: value for name, value in bound.arguments.items() if name != "self"}


def ignore_boolean_buffers_in_ddp(model: torch.nn.Module) -> None:
    """`--ignore_bias_buffers`, as TRL's `trl dpo` script applies it: torch's DistributedDataParallel leaves the
    model's boolean buffers (attention masks some models keep) out of its broadcasts, the fix for DDP's "invalid scalar
    type" with them (transformers#22482). DDP reads the list when it wraps the model, in `train()`."""
    model._ddp_params_and_buffers_to_ignore = [
        name for name, buffer in model.named_buffers() if buffer.dtype == torch.bool
    ]


def padding_free_hidden(args):
    """TRL 1.16 warns that `padding_free` is "temporarily unavailable" and switches it off; trl-padfree honours it, so
    TRL's constructor must not see it."""
    return swapped(args, "padding_free", False)


def fused_lm_head_added_with(add: Callable[[Callable], Callable]):
    """Around TRL's `__init__`: TRL adds its fused LM head through `add(trl's add_fused_lm_head)`. TRL must call it."""
    return swapped(
        trl_dpo_trainer,
        "add_fused_lm_head",
        add(trl_dpo_trainer.add_fused_lm_head),
        must_be_used="TRL's DPOTrainer adds its fused LM head some other way (update trl_padfree/modeling/fused_lm_head.py)",
    )


def reference_deepspeed_prepared_with(prepare: Callable):
    """Around TRL's `__init__`: its DeepSpeed preparation of the reference (`prepare_deepspeed(model, accelerator)`)
    goes through `prepare`. Its only other use there, a precompute engine over the policy, happens only without a
    reference. Whether TRL called it is checked on the reference afterwards (placement/deepspeed.py)."""
    return swapped(trl_dpo_trainer, "prepare_deepspeed", prepare)


def reference_fsdp_prepared_with(prepare: Callable[[Callable], Callable]):
    """Around TRL's `__init__`: its FSDP preparation of the reference (`prepare_fsdp(model, accelerator)`, its only
    use there) goes through `prepare(trl's prepare_fsdp)`; checked on the reference afterwards (placement/fsdp2.py)."""
    return swapped(trl_dpo_trainer, "prepare_fsdp", prepare(trl_dpo_trainer.prepare_fsdp))
