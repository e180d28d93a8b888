"""Make TRL's fused LM head find the backbone and the expert count of the models it patches.

TRL 1.16 computes DPO log-probs with a fused LM head (`trl.trainer.utils.add_fused_lm_head`, applied to the policy
and the reference in `DPOTrainer.__init__`). Its forward looks two things up on every call:

- the backbone, as `model.base_model` (trl/trainer/utils.py:1593 and :1616). transformers resolves that property as
  `getattr(model, model.base_model_prefix, model)`. `Llama4ForCausalLM` (and `MllamaForCausalLM`) declare
  `base_model_prefix = "language_model"`, a name kept for loading multimodal checkpoints, but hold the decoder stack
  as `model.model`, so `base_model` is the model itself: the "backbone" call runs the whole causal LM and
  utils.py:1618 fails with "'MoeCausalLMOutputWithPast' object has no attribute 'last_hidden_state'".
- the expert count, as `text_config.num_experts`, whenever router logits are requested (utils.py:1679): by the config
  (`output_router_logits=True`) or by DPOTrainer when the MoE auxiliary loss is on, which it is by default for any
  config declaring a nonzero `router_aux_loss_coef`. `GraniteMoeHybridConfig` and `Llama4TextConfig` spell it
  `num_local_experts` and map no `num_experts` alias, so it fails with "'GraniteMoeHybridConfig' object has no
  attribute 'num_experts'".

The fix, general rather than per class: a model whose `base_model` is itself gets its one `PreTrainedModel` child as
its instance's `base_model_prefix` (the class and its checkpoint loading are untouched); a MoE text config without
`num_experts` gets one, copied from the name it does use (`EXPERT_COUNT_NAMES`). The alias is a plain config
attribute, so a checkpoint saved while training carries `"num_experts"` too, equal to the real count; transformers
reads it back as an extra attribute that no modeling code of these classes reads. Both are applied by
`fused_lm_head_lookups`, around `trl.DPOTrainer.__init__`, to exactly the models TRL patches, before any of them runs
(the precomputed reference log-probs run inside `__init__`), and checked afterwards.

The same place sets the precision of the log-probs (docs/concepts/exactness.md, "bf16 engines"): with `fp32_log_probs` (unset,
it is on with padding-free training and off otherwise, as in TRL) FSDP2 leaves the models' float32 log-probs uncast (placement/fsdp2.py, `keep_root_outputs_dtype`), where it
would round their sums near -500 to multiples of 2; with `cast_lm_head_to_fp32` TRL's head gets its own flag of that
name (float32 logits tiles, outside autocast).

TRL names this module depends on (TRL >=1.16,<1.17, see `_compat.py`); `tests/test_seams.py` asserts each:
- `trl.trainer.dpo_trainer.add_fused_lm_head`: the module global `DPOTrainer.__init__` calls; swapped for the duration
  of `__init__`; its `cast_lm_head_to_fp32` keyword.
- the lookups inside the forward it installs: `getattr(self, "base_model")`, `self.get_output_embeddings()`,
  `text_config.num_experts` and `text_config.num_experts_per_tok`, `text_config` being
  `model.config.get_text_config()` taken when the head is added.
- `DPOTrainer.aux_loss_enabled`: whether training requests router logits.
"""

from __future__ import annotations

import contextlib
import functools

from transformers import PreTrainedModel

from ..costs.flops import EXPERT_COUNT_NAMES  # where configs keep the number of routed experts; TRL reads the first
from ..integrations.trl import fused_lm_head_added_with
from ..placement.fsdp2 import keep_root_outputs_dtype
from ..refusals.models import check_fused_lm_head_backbone, check_fused_lm_head_experts, check_fused_lm_head_output


def prepare_for_fused_lm_head(model: PreTrainedModel, router_logits: bool | None = None) -> None:
    """
    Make the lookups of TRL's fused LM head resolve on `model`, then check that they do.

    Call it on the model given to `add_fused_lm_head`, before its first fused forward. A model whose lookups already
    resolve (Llama, Qwen3-MoE, ...) is left as it is.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            The causal LM, unwrapped (for PEFT, `model.get_base_model()`).
        router_logits (`bool`, *optional*):
            Whether fused forwards will request router logits, so that the expert count is needed. Defaults to the
            config's `output_router_logits`.
    """
    _point_base_model_at_backbone(model)
    _add_expert_count_alias(model)
    check_fused_lm_head_lookups(model, router_logits)


def check_fused_lm_head_lookups(model: PreTrainedModel, router_logits: bool | None = None) -> None:
    """Raise, naming the class, if a lookup of TRL's fused LM head would fail or find the wrong module on `model`."""
    model_class = type(model).__name__
    backbone = model.base_model
    children = [name for name, child in model.named_children() if isinstance(child, PreTrainedModel)]
    wrong = ""
    if backbone is model:
        wrong = "the model itself"
    elif not isinstance(backbone, PreTrainedModel):
        wrong = type(backbone).__name__
    check_fused_lm_head_backbone(model_class, wrong, model.base_model_prefix, children)
    check_fused_lm_head_output(model_class, getattr(model.get_output_embeddings(), "weight", None) is not None)
    text_config = model.config.get_text_config()
    if router_logits is None:
        router_logits = bool(getattr(text_config, "output_router_logits", False))
    missing = None
    if router_logits:
        needed = ("num_experts", "num_experts_per_tok")
        missing = next((name for name in needed if not isinstance(getattr(text_config, name, None), int)), None)
    check_fused_lm_head_experts(model_class, type(text_config).__name__, missing, EXPERT_COUNT_NAMES)


@contextlib.contextmanager
def fused_lm_head_lookups(trainer, fp32_log_probs: bool = False, cast_lm_head_to_fp32: bool = False):
    """
    Around `trl.DPOTrainer.__init__` (the trainer's `super().__init__(...)`): every model that TRL gives a fused LM head
    is prepared by [`prepare_for_fused_lm_head`] as it is patched, whether it was passed in or loaded by TRL, and
    before any forward (reference log-probs are precomputed inside `__init__`). On leaving, checks that TRL did call
    the head through the expected name, and that each patched model resolves the expert count if training requests
    router logits (`trainer.aux_loss_enabled`, only known once `__init__` has run).

    With `fp32_log_probs`, FSDP2 (set up by then: TRL adds the heads after building its Accelerator, before it shards
    the reference) leaves the models' outputs in the dtype they were computed in; with `cast_lm_head_to_fp32`, each
    head projects in float32.
    """
    patched_models = []

    def adding_to_prepared(add_fused_lm_head):
        @functools.wraps(add_fused_lm_head)
        def add_fused_lm_head_to_prepared(model, *args, **kwargs):
            prepare_for_fused_lm_head(model)
            patched_models.append(model)
            if fp32_log_probs:
                keep_root_outputs_dtype(trainer.accelerator)
            if cast_lm_head_to_fp32:
                kwargs["cast_lm_head_to_fp32"] = True
            return add_fused_lm_head(model, *args, **kwargs)

        return add_fused_lm_head_to_prepared

    with fused_lm_head_added_with(adding_to_prepared):  # fails if TRL never called it
        yield
    for model in patched_models:
        check_fused_lm_head_lookups(model, router_logits=trainer.aux_loss_enabled or None)


def _point_base_model_at_backbone(model: PreTrainedModel) -> None:
    if model.base_model is not model:
        return
    # A causal LM holds its decoder stack as its one PreTrainedModel child (`self.model = Llama4TextModel(config)`).
    # Setting the prefix on the instance leaves the class, and the checkpoint loading that relies on it, as they are.
    children = [name for name, child in model.named_children() if isinstance(child, PreTrainedModel)]
    if len(children) == 1:
        model.base_model_prefix = children[0]


def _add_expert_count_alias(model: PreTrainedModel) -> None:
    text_config = model.config.get_text_config()
    if not hasattr(text_config, "output_router_logits") or hasattr(text_config, "num_experts"):
        return  # not a model with router logits, or TRL's name resolves (maybe through the config's attribute_map)
    counts = {getattr(text_config, name, None) for name in EXPERT_COUNT_NAMES[1:]} - {None}
    if len(counts) == 1:
        text_config.num_experts = counts.pop()
