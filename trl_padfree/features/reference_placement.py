"""`ReferencePlacement`: where the frozen reference model lives, in one object. TRL's constructor loads and prepares
the reference; trl-padfree changes where it goes and checks afterwards that it went there:

    before TRL's __init__   refuse `ref_offload` where it cannot apply; under ZeRO-3, load the reference offloaded
    during it               reroute TRL's preparation: FSDP2 a unit per layer (placement/fsdp2.py) with padding-free
                            training or ref_offload, ZeRO-3 offload (placement/deepspeed.py); a padded run without
                            ref_offload keeps TRL's
    after it                FSDP really set up; the reference really prepared that way (TRL may stop calling the
                            rerouted names); with precomputed log-probs, the offloaded reference released
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

from ..integrations.transformers import attn_implementation
from ..integrations.trl import get_config_model_id
from ..placement.deepspeed import (
    check_ref_offload,
    check_reference_offloaded,
    load_offloaded_reference,
    reference_prepared_by_own_config,
)
from ..placement.fsdp2 import (
    check_fsdp_engine,
    check_reference_sharded_by_layer,
    lm_head_tied,
    reference_sharded_by_layer,
)
from ..refusals.parallel import check_fsdp2_vision_lm_head
from ..settings import Settings


@dataclass(frozen=True)
class ReferencePlacement:
    offload: bool  # ref_offload
    fsdp_version: int | None  # what the run asks for; None without FSDP
    # FSDP2's reference a unit per layer: with padding_free=True or ref_offload; else TRL's one unit, as in TRL
    by_layer: bool = False

    @classmethod
    def before_init(cls, settings: Settings, args, model, ref_model, peft_config):
        """The placement `settings` ask for, and the reference to hand TRL (loaded offloaded under ZeRO-3)."""
        offload, fsdp_version = settings.ref_offload, settings.fsdp_version
        placement = cls(offload, fsdp_version, by_layer=fsdp_version == 2 and (offload or settings.padding_free))
        if placement.offload:
            check_ref_offload(args, model, ref_model, peft_config, placement.fsdp_version)
            if ref_model is None and placement.fsdp_version is None:
                ref_model = _load_offloaded_like_trl(model, args)
        return placement, ref_model

    def preparing(self, args):
        """Around TRL's `__init__`: its preparation of the reference, rerouted."""
        if self.by_layer:
            return reference_sharded_by_layer(offload=self.offload)
        if self.offload:
            return reference_prepared_by_own_config(args)
        return contextlib.nullcontext()

    def check(self, trainer) -> None:
        """After TRL's `__init__`: the engine and the reference are what was asked for."""
        check_fsdp_engine(self.fsdp_version, trainer.accelerator)
        if self.fsdp_version == 2:
            check_fsdp2_vision_lm_head(trainer.is_vision_dataset, lm_head_tied(trainer.model))
        if self.by_layer:
            check_reference_sharded_by_layer(trainer.ref_model, offload=self.offload)
        elif self.offload:
            check_reference_offloaded(trainer.ref_model)

    def release_after_precompute(self, trainer) -> None:
        """Every reference log-prob is in the datasets now: free an offloaded reference's CPU shards for training."""
        if self.offload and trainer.args.precompute_ref_log_probs:
            trainer.ref_model = None
            gc.collect()


def _load_offloaded_like_trl(model, args):
    # ZeRO-3 only (FSDP shards the reference TRL loads in CPU memory). The reference TRL would load (same checkpoint,
    # init kwargs, dtype and attention as the policy), but built under the reference's own ZeRO-3 config, so its
    # shards land in CPU memory
    init_kwargs = dict(args.model_init_kwargs or {})
    init_kwargs["device_map"] = None
    init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if isinstance(model, str):
        model_id = model
    else:
        model_id = get_config_model_id(model.config)
        init_kwargs.setdefault("dtype", model.dtype)
        init_kwargs.setdefault("attn_implementation", attn_implementation(model))
    return load_offloaded_reference(model_id, init_kwargs, args)
