"""`ref_offload`: the reference model on its own DeepSpeed ZeRO-3 config, parameters in pinned CPU memory.

TRL gives the reference model a copy of the policy's DeepSpeed config (minus the optimizer), so under ZeRO-3 a frozen
reference costs each GPU as much as the policy's sharded weights, and it inherits the policy's parameter offload or
lack of it. With `ref_offload=True` the reference gets its own stage-3 inference config with
`offload_param: {device: cpu, pin_memory: true}`, whatever the policy does:

    policy     ZeRO-3, its own offload settings      params + grads + optimizer states sharded over the GPUs
    reference  ZeRO-3, offload_param cpu (pinned)    its shards in CPU memory, fetched layer by layer per forward

The reference must also be *built* that way: DeepSpeed leaves a parameter where `zero.Init` first put it, so a
reference loaded under the policy's config would stay sharded on the GPUs. `load_offloaded_reference` loads it under
the reference config; `reference_prepared_by_own_config` makes TRL's trainer wrap it in that config's engine.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers.integrations import deepspeed as hf_deepspeed

from ..integrations.transformers import deepspeed_config_restored
from ..integrations.trl import create_model_from_path, reference_deepspeed_prepared_with
from ..refusals.placement import (
    check_deepspeed_preparation_rerouted,
    check_ref_offload_applies,
    check_reference_not_on_gpus,
)

OFFLOAD_PARAM = {"device": "cpu", "pin_memory": True}
# Config entries only an optimizer reads; an inference engine without one refuses or misuses them
TRAINING_ONLY_KEYS = ("optimizer", "scheduler")


def check_ref_offload(args, model, ref_model, peft_config, fsdp_version: int | None = None) -> None:
    """Refuse `ref_offload=True` where it cannot apply, before anything is loaded, naming the fix. `fsdp_version`:
    the FSDP version the run asks for (fsdp2.planned_fsdp_version), None without FSDP."""
    from accelerate.utils import is_peft_model

    plugin = args.deepspeed_plugin
    check_ref_offload_applies(
        zero_stage=None if plugin is None else plugin.zero_stage,
        fsdp_version=fsdp_version,
        separate_reference=ref_model is not None,
        peft=peft_config is not None or (not isinstance(model, str) and is_peft_model(model)),
        precompute=bool(args.precompute_ref_log_probs),
    )


def reference_deepspeed_config(policy_config: dict, args, hidden_size: int | None = None) -> dict:
    """The reference's inference config: the policy's precision and batch settings, ZeRO-3, parameters offloaded to
    pinned CPU memory, and no optimizer.

    `"auto"` values are filled the way the Trainer fills the policy's: from `args` (batch sizes, precision) by
    transformers' own resolver, and the bucket sizes it leaves for training time from the model's hidden size (or
    DeepSpeed's defaults when that is unknown).
    """
    config = copy.deepcopy(policy_config)
    for key in TRAINING_ONLY_KEYS:
        config.pop(key, None)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    zero["stage"] = 3
    zero["offload_param"] = dict(OFFLOAD_PARAM)
    with deepspeed_config_restored():  # building a transformers DeepSpeed config registers it globally
        resolver = hf_deepspeed.HfTrainerDeepSpeedConfig(config)
        resolver.trainer_config_process(args)
    config = resolver.config
    # DeepSpeed derives the global batch from the micro-batch; given both, it checks them against a world size that
    # `zero.Init` may see before distributed setup completes
    config.pop("train_batch_size", None)
    zero = config["zero_optimization"]
    bucket_sizes = {}
    if hidden_size is not None:
        bucket_sizes = {
            "reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            # Parameters smaller than this (norms, biases) stay whole on every GPU instead of being fetched each time
            "stage3_param_persistence_threshold": 10 * hidden_size,
        }
    for key, value in list(zero.items()):
        if value == "auto":
            if key in bucket_sizes:
                zero[key] = bucket_sizes[key]
            else:
                del zero[key]
    return config


@contextlib.contextmanager
def zero3_init_config(config: dict | None):
    """Make transformers build models under `config` (ZeRO-3 `zero.Init`), or unpartitioned with `None`, restoring
    the trainer's config afterwards."""
    with deepspeed_config_restored():
        if config is None:
            hf_deepspeed.unset_hf_deepspeed_config()
            yield
        else:
            active = hf_deepspeed.HfDeepSpeedConfig(config)  # held here: transformers keeps only a weak reference
            yield
            del active


def _hidden_size(config) -> int | None:
    text_config = config.get_text_config()
    hidden_sizes = getattr(text_config, "hidden_sizes", None)
    return max(hidden_sizes) if hidden_sizes else getattr(text_config, "hidden_size", None)


def load_offloaded_reference(model_id: str, init_kwargs: dict, args):
    """Load the reference from `model_id` straight into pinned CPU shards (no process ever holds it on a GPU)."""
    from transformers import AutoConfig

    config_kwargs = {k: init_kwargs[k] for k in ("revision", "trust_remote_code") if k in init_kwargs}
    hidden_size = _hidden_size(AutoConfig.from_pretrained(model_id, **config_kwargs))
    config = reference_deepspeed_config(args.deepspeed_plugin.deepspeed_config, args, hidden_size)
    with zero3_init_config(config):
        return create_model_from_path(model_id, **init_kwargs)


def prepare_offloaded_reference(model: torch.nn.Module, accelerator, args):
    """Wrap the reference in a DeepSpeed inference engine with its own offloaded ZeRO-3 config."""
    import deepspeed

    check_reference_not_on_gpus(_sharded_off_cpu(model))
    config = reference_deepspeed_config(
        accelerator.state.deepspeed_plugin.deepspeed_config, args, _hidden_size(model.config)
    )
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def _sharded_off_cpu(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_tensor") and p.ds_tensor.device.type != "cpu" for p in model.parameters())


def check_reference_offloaded(model: torch.nn.Module | None) -> None:
    """After TRL's `__init__`: the reference really is offloaded. `reference_prepared_by_own_config` reroutes a
    module-level name of TRL's; if TRL stops calling it, the reference would stay sharded on the GPUs."""
    check_deepspeed_preparation_rerouted(model is None or zero3_offloaded(model))


def zero3_offloaded(model: torch.nn.Module) -> bool:
    """Whether every parameter of `model` (a DeepSpeed engine or its module) is a ZeRO-3 shard held in CPU memory by
    an engine configured to offload its parameters there."""
    zero_offload_param = getattr(model, "zero_offload_param", None)  # a DeepSpeed engine's own offload settings
    offload_param = zero_offload_param() if zero_offload_param is not None else None
    if offload_param is None:
        return False
    module = getattr(model, "module", model)
    return offload_param.device == "cpu" and all(
        hasattr(p, "ds_tensor") and p.ds_tensor.device.type == "cpu" for p in module.parameters()
    )


def reference_prepared_by_own_config(args):
    """While TRL's `DPOTrainer.__init__` runs, route its DeepSpeed preparation of the reference model through
    `prepare_offloaded_reference`. TRL prepares the reference inline in `__init__`, through a module-level name, so
    there is no narrower seam; `check_reference_offloaded` verifies it afterwards."""
    return reference_deepspeed_prepared_with(
        lambda model, accelerator: prepare_offloaded_reference(model, accelerator, args)
    )
