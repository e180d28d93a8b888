"""FSDP2 (accelerate's `fsdp_version: 2`): the bytes per GPU and per node of the policy and the reference.

accelerate's `fsdp2_prepare_model` (accelerate 1.15, `utils/fsdp_utils.py`) shards the policy with `fully_shard` over
all N GPUs (nodes x GPUs per node), in these units:

    decoder layers   one unit each (TRANSFORMER_BASED_WRAP), gathered for their forward and again for their backward
    embedding        its own unit when untied, freed after its forward like a layer
    tail             final norm + LM head (+ the embedding when tied), reshard_after_forward=False: gathered from its
                     forward to its backward
    root             whatever is left (GPT-2's position embedding), also kept gathered

With `mixed_precision: bf16` it upcasts the trainable parameters to fp32 and sets MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=bf16): units are gathered and gradients reduce-scattered in bf16, and the sharded gradients are kept in the
parameters' fp32. So per GPU, with b the bytes of the precision (2 in bf16/fp16, 4 in fp32):

    sharded states     16 P / N               fp32 weights 4, fp32 gradients 4, Adam moments 8
    gathered units     b (2 layer + tail)     the layer computed and the one prefetched, and the tail
    gradient buffers   2 b layer              a layer's unsharded gradients and the reduce-scatter input they are
                                              copied into (torch keeps one such input in flight)

`fsdp_offload_params: true` (CPUOffloadPolicy, pinned) moves the sharded states to CPU memory: 16 P / nodes per node.

trl-padfree shards the frozen reference like the policy, a unit per decoder layer and the root, in the training
precision (b P / N per GPU); with `ref_offload`, or when the policy is offloaded, its shards sit in pinned CPU memory
instead (b P / nodes per node). Formulas and what is left out: docs/concepts/memory-planning.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .setup import Setup
from .units import BYTES_PER_PARAM

if TYPE_CHECKING:
    from .shapes import ModelShape

SHARDED_BYTES_PER_PARAM = 16  # fp32 master weights 4, fp32 gradients 4, Adam's two fp32 moments 8
LAYERS_GATHERED = 2  # the layer being computed and the next one, prefetched
GRADIENT_BUFFERS = 2  # a layer's unsharded gradients and the reduce-scatter input (reduce dtype = param dtype)
CONFIG = "fsdp2"  # the shipped accelerate config: `trl-padfree dpo --accelerate_config fsdp2`


def kept_gathered_params(shape: ModelShape) -> int:
    """Parameters of the policy's units that stay gathered from forward to backward: the tail (final norm, LM head,
    and the embedding when tied) and the root's leftovers; everything outside the decoder layers but an untied
    embedding, which is its own unit and freed after its forward."""
    untied_embedding = 0 if shape.tied_embeddings else shape.input_embedding_params
    return shape.non_layer_params - untied_embedding


def gathered_bytes(shape: ModelShape, setup: Setup) -> int:
    """The policy's unsharded parameters at the turn from forward to backward: the tail, the layer computed and the
    one prefetched, in the compute precision. An upper bound: the tail is freed after its backward, before the second
    layer is needed."""
    bytes_per_value = BYTES_PER_PARAM[setup.precision]
    return bytes_per_value * (LAYERS_GATHERED * shape.decoder_layer_params + kept_gathered_params(shape))


def gradient_buffer_bytes(shape: ModelShape, setup: Setup) -> int:
    """A layer's gradients on their way to their shards: unsharded, then copied into the reduce-scatter input."""
    return GRADIENT_BUFFERS * BYTES_PER_PARAM[setup.precision] * shape.decoder_layer_params


def sharded_state_bytes(shape: ModelShape, setup: Setup) -> int:
    """One GPU's shards of the fp32 weights, gradients and Adam moments (on CPU with `fsdp_offload_params`)."""
    return SHARDED_BYTES_PER_PARAM * shape.total_params // setup.total_gpus


def policy_states(shape: ModelShape, setup: Setup) -> tuple[int, int]:
    """Per-GPU and per-node CPU bytes of the policy's weights, gradients and Adam states under FSDP2."""
    working_set = gathered_bytes(shape, setup) + gradient_buffer_bytes(shape, setup)
    if setup.fsdp_offload_params:
        # Each node holds its GPUs' shards: 16 P / N x GPUs per node
        return working_set, sharded_state_bytes(shape, setup) * setup.gpus_per_node
    return sharded_state_bytes(shape, setup) + working_set, 0


def reference_offloaded(setup: Setup) -> bool:
    """Whether the reference's shards live in CPU memory: with `ref_offload`, or following the policy's
    `fsdp_offload_params` (trl-padfree gives the reference the policy's offload policy unless `ref_offload` is set)."""
    return setup.reference == "offload" or (setup.reference == "gpu" and setup.fsdp_offload_params)


def reference_gathered_excess(shape: ModelShape, setup: Setup) -> int:
    """What the reference's forward gathers beyond memory the policy needs anyway at its own peak.

    TRL runs the reference's forward between the policy's forward and backward. Its units gathered then (two layers
    and its root: embeddings, final norm, LM head) share the GPU with the policy's saved activations and gathered
    tail, but not with the policy's two gathered layers and gradient buffers, which exist only in the backward. The
    layers cancel; the root counts where it outgrows the gradient buffers (models with a large vocabulary).
    """
    root = shape.non_layer_params - GRADIENT_BUFFERS * shape.decoder_layer_params
    return BYTES_PER_PARAM[setup.precision] * max(0, root)


def reference_memory(shape: ModelShape, setup: Setup) -> tuple[int, int]:
    """Per-GPU and per-node CPU bytes of the frozen reference under FSDP2: its shards, b P / N per GPU or b P / nodes
    per node when offloaded, and what its forward gathers beyond the policy's own peak."""
    if setup.reference == "precompute":
        return 0, 0
    weights = BYTES_PER_PARAM[setup.precision] * shape.total_params
    excess = reference_gathered_excess(shape, setup)
    if reference_offloaded(setup):
        return excess, weights // setup.nodes
    return weights // setup.total_gpus + excess, 0


def accelerate_config(setup: Setup) -> dict:
    """The accelerate config to launch the planned run with, and the settings to change in it."""
    changes = {"fsdp_offload_params": True} if setup.fsdp_offload_params else {}
    return {"file": CONFIG, "changes": changes}
