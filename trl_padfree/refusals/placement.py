"""Refusals of where the reference model lives: `ref_offload` under DeepSpeed ZeRO-3 and FSDP2."""

from __future__ import annotations

# ---- where the reference model lives: DeepSpeed and FSDP ----


def check_ref_offload_applies(
    zero_stage: int | None,
    fsdp_version: int | None,
    separate_reference: bool,
    peft: bool,
    precompute: bool,
) -> None:
    """`ref_offload=True` where it cannot apply, before anything is loaded. `zero_stage`: the DeepSpeed config's,
    None without DeepSpeed; `fsdp_version`: None without FSDP."""
    if zero_stage is None and fsdp_version is None:
        raise ValueError(
            "ref_offload=True needs DeepSpeed ZeRO-3 or FSDP2: launch with `trl-padfree dpo --accelerate_config zero3` "
            "or `--accelerate_config fsdp2` (or pass a stage-3 `deepspeed` config), or set ref_offload=False."
        )
    if fsdp_version is not None and fsdp_version != 2:
        raise ValueError(
            f"ref_offload=True under FSDP needs FSDP2, but the run asks for fsdp_version {fsdp_version}. Use "
            "the shipped fsdp2 config (`--accelerate_config fsdp2`, fsdp_version: 2), or set ref_offload=False."
        )
    if fsdp_version is None and zero_stage != 3:
        raise ValueError(
            f"ref_offload=True needs DeepSpeed ZeRO-3, but the DeepSpeed config has zero stage {zero_stage}: "
            "parameter offload exists only at stage 3 (TRL gives the reference stage 0 below it, a full copy per "
            "GPU). Use the shipped zero3 config (`--accelerate_config zero3`), or set ref_offload=False."
        )
    if not separate_reference and peft:
        raise ValueError(
            "ref_offload=True has no reference model to offload: with a PEFT adapter the reference is the policy "
            "with its adapter disabled, which costs no extra memory. Set ref_offload=False."
        )
    # Under FSDP TRL loads a reference to precompute with (the policy is not sharded yet), which is offloaded
    if not separate_reference and precompute and fsdp_version is None:
        raise ValueError(
            "ref_offload=True has no reference model to offload: with precompute_ref_log_probs=True and no "
            "`ref_model`, TRL computes the reference log-probs with the untrained policy before training and keeps "
            "no reference. Set ref_offload=False (or pass a `ref_model` to precompute with, offloaded and released "
            "after precomputation)."
        )


def check_reference_not_on_gpus(sharded_on_gpus: bool) -> None:
    if sharded_on_gpus:
        raise ValueError(
            "ref_offload=True got a reference model already sharded onto the GPUs by ZeRO-3 (it was loaded under "
            "the policy's DeepSpeed config, and DeepSpeed keeps parameters where they were first sharded). Pass no "
            "`ref_model` (the trainer then loads it offloaded), or load it outside the ZeRO-3 context."
        )


def check_deepspeed_preparation_rerouted(offloaded: bool) -> None:
    """After TRL's `__init__`: the reference really is offloaded (TRL may stop calling the rerouted name)."""
    if not offloaded:
        raise RuntimeError(
            "ref_offload=True, but the reference model's parameters are not ZeRO-3 shards in CPU memory: this TRL "
            "version no longer prepares it through `trl.trainer.dpo_trainer.prepare_deepspeed`, which trl-padfree "
            "reroutes. Pin TRL to the tested range (pyproject.toml), or set ref_offload=False."
        )


def check_fsdp_set_up_as_asked(requested_version: int | None, fsdp_set_up: bool, distributed_type: str) -> None:
    """A run that asked for FSDP but got none: on CPU processes accelerate gives an FSDP config plain data
    parallelism (its distributed type there is MULTI_CPU), so nothing would be sharded."""
    if requested_version is not None and not fsdp_set_up:
        raise ValueError(
            f"This run asks for FSDP (fsdp_version {requested_version}) but accelerate set up {distributed_type}, "
            "which does not shard the model: accelerate runs FSDP only on GPUs (and other accelerators), and on CPU "
            "processes falls back to data parallelism. Launch on GPUs, or use a data-parallel config "
            "(`--accelerate_config multi_gpu`) for CPU runs."
        )


def check_reference_not_fsdp_wrapped(offload: bool) -> None:
    if offload:
        raise ValueError(
            "ref_offload=True got a reference model already wrapped by FSDP2, which trl-padfree cannot offload any "
            "more. Pass the unwrapped model (or none: TRL then loads it), or set ref_offload=False."
        )


def check_fsdp_preparation_rerouted(sharded_as_asked: bool, offload: bool) -> None:
    """After TRL's `__init__`: the reference went through trl-padfree's FSDP2 preparation."""
    if not sharded_as_asked:
        raise RuntimeError(
            "The reference model was not sharded by trl-padfree's FSDP2 preparation: this TRL version no longer "
            "prepares it through `trl.trainer.dpo_trainer.prepare_fsdp`, which trl-padfree reroutes. "
            + ("Its parameters are not offloaded to CPU memory. " if offload else "")
            + "Pin TRL to the tested range (pyproject.toml), or report it."
        )
