"""Estimates: the memory a DPO run needs, per GPU and per node of CPU memory.

Per GPU, these parts are added up and compared with the GPU's memory:

    policy states   weights, gradients, Adam states: DeepSpeed's own estimators (ZeRO-1/2/3), 16 bytes/param at stage 0,
                    or FSDP2's shards and gathered layers (`fsdp2`)
    reference       the frozen reference model, which DeepSpeed's estimators leave out
    activations     an estimate for one policy forward and backward of a packed micro-batch of T tokens (of its
                    T / C tokens per GPU when C GPUs share the row: `context_parallel`)
    K/V buffers     with context parallelism, the whole row's keys and values that attention gathers
                    (`context_parallel`)
    reserve         a fixed allowance for the CUDA context, NCCL and DeepSpeed buffers, fragmentation

Per node, CPU memory adds DeepSpeed's CPU estimate (or FSDP2's offloaded shards) for the policy and the offloaded
reference. Formulas, assumptions and what is not modelled: docs/concepts/memory-planning.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

# TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`) projects [tokens, vocabulary] tiles of these sizes at a
# time (4096 x 32768 in TRL 1.16), so the full logits never exist. Read from TRL, so the estimate follows the installed
# release; tests/integrations/test_seams.py checks that TRL still tiles by them
from ..integrations.trl import LOGITS_TILE_TOKENS, LOGITS_TILE_VOCAB
from . import context_parallel, fsdp2
from .setup import REFERENCE_PLACES, Setup
from .shapes import ModelShape
from .units import BYTES_PER_PARAM


def check_setup(setup: Setup, shape: ModelShape) -> None:
    """Refuse a setup DeepSpeed, FSDP2 or TRL would not run, or one the estimators do not cover, naming the fix."""
    if min(setup.gpus_per_node, setup.nodes, setup.tokens) < 1 or setup.gpu_memory <= 0:
        raise ValueError("--gpus-per-node, --nodes, --tokens and --gpu-memory must be positive.")
    if setup.precision not in BYTES_PER_PARAM or setup.reference not in REFERENCE_PLACES:
        raise ValueError(f"--precision must be one of {list(BYTES_PER_PARAM)}, --reference one of {REFERENCE_PLACES}.")
    # Under every engine: ZeRO and FSDP2 shard over all GPUs whatever the groups sharing rows
    context_parallel.check_context_parallel(setup)
    if setup.fsdp2:
        check_fsdp2_setup(setup, shape)
    else:
        check_deepspeed_setup(setup, shape)


def check_fsdp2_setup(setup: Setup, shape: ModelShape) -> None:
    """FSDP2 shards like ZeRO-3 and has its own offload: the DeepSpeed options cannot go with it."""
    if setup.zero_stage is not None:
        raise ValueError(
            f"--fsdp2 and --zero-stage {setup.zero_stage} are exclusive: FSDP2 shards parameters, gradients and "
            "optimizer states over all GPUs like ZeRO-3. Drop --zero-stage, or drop --fsdp2 to plan DeepSpeed."
        )
    if setup.offload_optimizer or setup.offload_param:
        raise ValueError(
            "--offload-optimizer and --offload-param are DeepSpeed's: under --fsdp2 use --fsdp2-offload-params "
            "(fsdp_offload_params: true), which moves parameters, gradients and optimizer states to CPU together."
        )
    if shape.decoder_layer_params is None:
        raise ValueError(
            "--fsdp2 needs the model's decoder layers (FSDP2 gathers them one unit at a time): give a config, a local "
            "folder or a hub name instead of a parameter count."
        )


def check_deepspeed_setup(setup: Setup, shape: ModelShape) -> None:
    """Refuse what DeepSpeed or TRL would not run, or what DeepSpeed's estimators do not cover."""
    if setup.fsdp_offload_params:
        raise ValueError(
            "--fsdp2-offload-params needs --fsdp2; with DeepSpeed, offload with --offload-param --offload-optimizer "
            "(--zero-stage 3)."
        )
    if setup.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage must be 0 (no DeepSpeed), 1, 2 or 3, not {setup.zero_stage}.")
    if setup.zero_stage == 0 and setup.offload_optimizer:
        raise ValueError("--offload-optimizer needs DeepSpeed: use --zero-stage 1, 2 or 3.")
    if setup.offload_param and (setup.zero_stage != 3 or not setup.offload_optimizer):
        raise ValueError(
            "--offload-param needs --zero-stage 3 and --offload-optimizer (DeepSpeed's estimator models parameter "
            "offload together with optimizer offload)."
        )
    if setup.reference == "offload" and setup.zero_stage != 3:
        raise ValueError(
            "--reference offload (ref_offload=True) needs --zero-stage 3 or --fsdp2 (parameter offload exists only "
            "there); use --reference precompute."
        )
    if setup.precision == "fp32" and setup.zero_stage > 0:
        raise NotImplementedError(
            "DeepSpeed's estimators model 16-bit training with fp32 master weights: use --precision bf16 or fp16, "
            "or --zero-stage 0 for fp32."
        )
    if setup.zero_stage == 3 and shape.largest_layer_params is None:
        raise ValueError(
            "ZeRO-3 needs the largest layer's parameter count: give a config instead of a count, or --largest-layer "
            "(usually the embedding, vocab_size x hidden_size)."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Estimates


def _deepspeed_estimators():
    try:
        # On a machine without GPU the import logs "Setting accelerator to CPU" to stdout, into the report
        quiet = logging.getLogger("DeepSpeed")
        quiet.addFilter(_drop_record)
        try:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        finally:
            quiet.removeFilter(_drop_record)
    except ImportError as error:
        raise ImportError(
            "ZeRO estimates come from DeepSpeed's own estimators: pip install deepspeed (or 'trl-padfree[deepspeed]'); "
            "--zero-stage 0 needs no DeepSpeed."
        ) from error
    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


def _drop_record(record: logging.LogRecord) -> bool:
    return False


def policy_states(shape: ModelShape, setup: Setup) -> tuple[int, int]:
    """Per-GPU and per-node CPU bytes of the policy's weights, gradients and Adam states (FSDP2: `fsdp2.policy_states`).

    ZeRO-2 and ZeRO-3 are DeepSpeed's own estimators, called as they are (`additional_buffer_factor` 1.5 on CPU).
    ZeRO-1 is DeepSpeed's ZeRO-2 estimate plus the 16-bit gradients stage 1 does not partition: 2P(1 - 1/N) bytes.
    Stage 0 (plain data parallelism, no DeepSpeed) is 16 bytes per parameter on every GPU: 16-bit weights and
    gradients, fp32 master weights and two Adam moments (fp32 training: 4 + 4 + 8), and no CPU part.
    """
    params = shape.total_params
    if setup.fsdp2:
        return fsdp2.policy_states(shape, setup)
    if setup.zero_stage == 0:
        return 16 * params, 0
    estimate_zero2, estimate_zero3 = _deepspeed_estimators()
    if setup.zero_stage == 3:
        cpu, gpu, _ = estimate_zero3(
            total_params=params,
            largest_layer_params=shape.largest_layer_params,
            num_gpus_per_node=setup.gpus_per_node,
            num_nodes=setup.nodes,
            cpu_offload=setup.offload_optimizer,
            cpu_offload_params=setup.offload_param,
            zero_init=setup.zero_init,
        )
        return gpu, cpu
    cpu, gpu = estimate_zero2(
        total_params=params,
        num_gpus_per_node=setup.gpus_per_node,
        num_nodes=setup.nodes,
        cpu_offload=setup.offload_optimizer,
    )
    if setup.zero_stage == 1:
        gpu += 2 * params - 2 * params // setup.total_gpus
    return gpu, cpu


def reference_memory(shape: ModelShape, setup: Setup) -> tuple[int, int]:
    """Per-GPU and per-node CPU bytes of the frozen reference model, which DeepSpeed's estimators leave out.

    Its weights are 2 bytes per parameter in bf16/fp16 (4 in fp32). At ZeRO-3 TRL partitions it like the policy: 1/N of
    them per GPU; with `ref_offload` the partitions sit in pinned CPU memory, 1/nodes of them per node. Below ZeRO-3 TRL
    wraps it at stage 0: a whole copy on every GPU. Precomputed log-probs leave no reference model during training.
    FSDP2: `fsdp2.reference_memory`.
    """
    if setup.fsdp2:
        return fsdp2.reference_memory(shape, setup)
    weights = BYTES_PER_PARAM[setup.precision] * shape.total_params
    if setup.reference == "precompute":
        return 0, 0
    if setup.reference == "offload":
        return 0, weights // setup.nodes
    if setup.zero_stage == 3:
        return weights // setup.total_gpus, 0
    return weights, 0


def layer_activation_bytes_per_token(shape: ModelShape, precision: str) -> int:
    """Bytes one decoder layer keeps for its backward, per token, with a varlen flash attention (no tokens² term).

        norms       2 x (4 + b) x h      two RMSNorms: the fp32 upcast of their input, and the normalised value
        attention   b x (h + 2q + 2kv)   the normed input, q, k, v and the attention output
        MLP         b x (h + 4i)         the normed input, gate, up, SiLU(gate) and their product (2i without a gate)

    b is bytes per activation (2 in bf16/fp16, 4 in fp32), h the hidden size, q and kv the query and key-value widths,
    i the MLP width. Checked against the tensors autograd saves in a tiny Llama (tests/plan/test_plan.py).
    """
    b, h, i = BYTES_PER_PARAM[precision], shape.hidden_size, shape.intermediate_size
    mlp = (4 if shape.gated_mlp else 2) * b * i
    return 2 * (4 + b) * h + b * (h + 2 * shape.q_dim + 2 * shape.kv_dim) + b * h + mlp


def activation_memory(shape: ModelShape, setup: Setup) -> int | None:
    """An estimate of the activation memory of one policy forward and backward over T packed tokens, per GPU. With
    context parallelism T is the GPU's chunk of the row (`context_parallel.local_tokens`): everything but attention runs
    on it, and `context_parallel.buffer_bytes` adds what attention holds of the whole row.

    With L layers and `layer` = `layer_activation_bytes_per_token` x T:
        checkpointing on    L x b x h x T (each layer's input) + 2 x layer (one layer recomputed, its backward)
        checkpointing off   L x layer + layer (the backward's working memory)
    plus the LM head of TRL's fused log-prob kernel, which never holds the full logits: the final norm, (4 + b) x h x T
    and b x h x T, one [min(T, 4096), min(V, 32768)] logits tile, and in the backward an fp32 gradient of the hidden
    states (4 x h x T) and of the head's weight, cast back to b bytes ((4 + b) x V x h). None without a layer shape.
    """
    if shape.no_activations_reason is not None:
        return None
    b, h, tokens = BYTES_PER_PARAM[setup.precision], shape.hidden_size, context_parallel.local_tokens(setup)
    layer = layer_activation_bytes_per_token(shape, setup.precision) * tokens
    if setup.activation_checkpointing:
        layers = shape.num_layers * b * h * tokens + 2 * layer
    else:
        layers = (shape.num_layers + 1) * layer
    logits_tile = b * min(tokens, LOGITS_TILE_TOKENS) * min(shape.vocab_size, LOGITS_TILE_VOCAB)
    head = (4 + 2 * b) * h * tokens + logits_tile + 4 * h * tokens + (4 + b) * shape.vocab_size * h
    return layers + head + vision_activation_memory(shape, setup)


def encoded_image_tokens(setup: Setup) -> int:
    """The image tokens one GPU of a row encodes: an even share of the row's (`deal_images`, parallel/image_shares.py;
    a share is whole sequences, so a row of few image-heavy sequences deals less evenly), or all of them."""
    if setup.deal_images:
        return -(-setup.image_tokens // setup.context_parallel_size)
    return setup.image_tokens


def vision_activation_memory(shape: ModelShape, setup: Setup) -> int:
    """The vision tower's share of `activation_memory`, on the image tokens one GPU encodes (`encoded_image_tokens`).
    The decoder layer's formula on the tower's width, over P = image tokens x patches per token (a LayerNorm tower
    without a gate is counted as gated, the upper bound); 0 for a text model or a row without images."""
    if shape.vision_layers is None or not setup.image_tokens:
        return 0
    b, h = BYTES_PER_PARAM[setup.precision], shape.vision_hidden_size
    patches = encoded_image_tokens(setup) * shape.vision_patches_per_token
    tower = ModelShape(
        "vision tower", 0, None, num_layers=shape.vision_layers, hidden_size=h,
        intermediate_size=shape.vision_intermediate_size, q_dim=h, kv_dim=h,
    )  # fmt: skip
    layer = layer_activation_bytes_per_token(tower, setup.precision) * patches
    if setup.activation_checkpointing:
        return shape.vision_layers * b * h * patches + 2 * layer
    return (shape.vision_layers + 1) * layer


@dataclass
class Estimate:
    """Bytes per GPU and per node of CPU memory, and whether they fit."""

    policy_gpu: int
    reference_gpu: int
    activations_gpu: int | None  # None: not estimated, counted as 0
    context_parallel_gpu: int | None  # the whole row's K/V buffers; 0 without context parallelism, None: not estimated
    vision_gpu: int  # of the activations, the vision tower's (on the image tokens one GPU encodes)
    reserve_gpu: int
    gpu_total: int
    gpu_memory: int
    policy_cpu: int
    reference_cpu: int
    cpu_total: int
    cpu_memory: int | None
    gpu_fits: bool
    cpu_fits: bool | None  # None: no --cpu-memory given, not checked

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.cpu_fits is not False


def estimate(shape: ModelShape, setup: Setup) -> Estimate:
    check_setup(setup, shape)
    policy_gpu, policy_cpu = policy_states(shape, setup)
    reference_gpu, reference_cpu = reference_memory(shape, setup)
    activations = activation_memory(shape, setup)
    row_buffers = context_parallel.buffer_bytes(shape, setup)
    gpu_total = policy_gpu + reference_gpu + (activations or 0) + (row_buffers or 0) + setup.reserve
    cpu_total = policy_cpu + reference_cpu
    return Estimate(
        policy_gpu=policy_gpu,
        reference_gpu=reference_gpu,
        activations_gpu=activations,
        context_parallel_gpu=row_buffers,
        vision_gpu=vision_activation_memory(shape, setup) if activations is not None else 0,
        reserve_gpu=setup.reserve,
        gpu_total=gpu_total,
        gpu_memory=setup.gpu_memory,
        policy_cpu=policy_cpu,
        reference_cpu=reference_cpu,
        cpu_total=cpu_total,
        cpu_memory=setup.cpu_memory,
        gpu_fits=gpu_total <= setup.gpu_memory,
        cpu_fits=None if setup.cpu_memory is None else cpu_total <= setup.cpu_memory,
    )
