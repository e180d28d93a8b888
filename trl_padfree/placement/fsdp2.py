"""FSDP2 (accelerate's `fsdp_version: 2`): the reference model sharded layer by layer, in CPU memory with `ref_offload`.

accelerate shards the policy itself, one `fully_shard` unit per decoder layer. TRL 1.16 shards the reference with a
single `fully_shard` on the whole model, so every reference forward gathers all of its parameters at once: a full
unsharded copy of the reference on each GPU at that moment. This module shards the reference much as accelerate
shards the policy, so its forward holds the root (LM head, final norm) and a layer or two unsharded at a time:

    policy     accelerate's units (decoder layers, embeddings, tail), the config's offload policy
    reference  a unit per decoder layer, the input embeddings (unless tied to the LM head) and the root; with
               ref_offload=True, FSDP2's CPUOffloadPolicy whatever the policy does: its shards stay in CPU memory
               and each unit is copied in for its all-gather

The arithmetic is the same either way (sharding moves parameters, not the computation).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..integrations.trl import reference_fsdp_prepared_with
from ..refusals.placement import (
    check_fsdp_preparation_rerouted,
    check_fsdp_set_up_as_asked,
    check_reference_not_fsdp_wrapped,
)


def planned_fsdp_version(args) -> int | None:
    """The FSDP version this run asks for, or None: from the `fsdp`/`fsdp_config` training arguments, or from the
    environment `accelerate launch` sets for an FSDP config. Known before the Trainer builds its Accelerator."""
    if args.fsdp_plugin_args is not None:  # transformers' reading of `fsdp` and `fsdp_config`
        return int(args.fsdp_plugin_args.get("fsdp_version", 1))
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def check_fsdp_engine(requested_version: int | None, accelerator) -> None:
    """Refuse a run that asked for FSDP but got none, as `accelerator` was set up (`check_fsdp_set_up_as_asked` says
    why)."""
    fsdp_set_up = getattr(accelerator.state, "fsdp_plugin", None) is not None
    check_fsdp_set_up_as_asked(requested_version, fsdp_set_up, accelerator.distributed_type.name)


def shard_reference(model: torch.nn.Module, accelerator, offload: bool) -> torch.nn.Module:
    """Shard the frozen reference with FSDP2: a unit per decoder layer (the policy's wrap policy), the input
    embeddings, and the root; with `offload`, its shards live in CPU memory (pinned where there is a GPU to copy them
    to)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version != 2:
        raise ValueError(f"shard_reference needs FSDP2, got fsdp_version {plugin.fsdp_version}.")
    if isinstance(model, FSDPModule):  # the caller sharded it already
        check_reference_not_fsdp_wrapped(offload)
        model._padfree_reference_offloaded = False
        return model
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if offload:
        offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    else:
        offload_policy = plugin.cpu_offload
    shard_options = {
        "reshard_after_forward": True,  # no backward follows: free each layer's gathered parameters at once
        "offload_policy": offload_policy,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }
    is_layer = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if is_layer is not None:
        for module in list(model.modules())[1:]:
            if is_layer(module) and not isinstance(module, FSDPModule):
                fully_shard(module, **shard_options)
    # The embeddings are gathered only for their own lookup; tied to the LM head, they stay with it in the root.
    # The LM head stays in the root: TRL's fused LM head reads its weight without calling it, so it would get no
    # unit of its own gathered
    embeddings = model.get_input_embeddings()
    if not isinstance(embeddings, FSDPModule) and not lm_head_tied(model):
        fully_shard(embeddings, **shard_options)
    fully_shard(model, **shard_options)
    model.eval()
    model._padfree_reference_offloaded = offload  # what check_reference_sharded_by_layer looks for
    return model


def keep_root_outputs_dtype(accelerator) -> None:
    """Under FSDP2 with a low-precision `param_dtype`, stop `fully_shard` from casting module outputs to the policy's
    `output_dtype`. Inside the model every output is in that dtype anyway; what changes is the root's: TRL's fused LM
    head returns float32 log-probs, which the cast would round to bf16 (a sequence's log-prob of -500 to a multiple
    of 2). accelerate's bf16 policy (`FullyShardedDataParallelPlugin.set_mixed_precision`) sets `output_dtype` to the
    training dtype up to 1.15 and leaves it unset from 1.16, so from 1.16 this changes only a policy given its own
    `output_dtype`. Applies to every model sharded afterwards, the policy (prepared at train time) and the reference
    (`shard_reference`). No-op without FSDP2."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or plugin.fsdp_version != 2:
        return
    policy = plugin.mixed_precision_policy
    if policy is not None and getattr(policy, "output_dtype", None) is not None:
        plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)


def lm_head_tied(model: torch.nn.Module) -> bool:
    """Whether the LM head is the input embeddings' weight (or the model has no LM head)."""
    head = model.get_output_embeddings()
    return head is None or head.weight is model.get_input_embeddings().weight


def check_reference_sharded_by_layer(model: torch.nn.Module | None, offload: bool) -> None:
    """After TRL's `__init__`: the reference went through `shard_reference`. `reference_sharded_by_layer` reroutes a
    module-level name of TRL's; if TRL stops calling it, fail here rather than train with TRL's single unit (or, with
    ref_offload, with the reference on the GPUs)."""
    sharded = model is None or getattr(model, "_padfree_reference_offloaded", None) == offload
    check_fsdp_preparation_rerouted(sharded, offload)


def reference_sharded_by_layer(offload: bool):
    """While TRL's `DPOTrainer.__init__` runs, route its FSDP preparation of the reference (the module-level
    `prepare_fsdp`, its only use there) through `shard_reference`; `check_reference_sharded_by_layer` verifies it."""

    def prepare_with(trl_prepare):
        def prepare(model, accelerator):
            if accelerator.state.fsdp_plugin.fsdp_version != 2:
                return trl_prepare(model, accelerator)
            return shard_reference(model, accelerator, offload)

        return prepare

    return reference_fsdp_prepared_with(prepare_with)
