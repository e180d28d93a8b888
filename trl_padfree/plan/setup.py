"""The hardware and training choices a plan is made for: one frozen `Setup` that every estimator reads.

Its own module, below `memory`, `fsdp2` and `context_parallel`, so that each of them can take a `Setup` without
importing another.
"""

from __future__ import annotations

from dataclasses import dataclass

from .units import GiB

REFERENCE_PLACES = ("gpu", "offload", "precompute")
# CUDA context (~0.5 GiB), NCCL buffers, DeepSpeed's bucket and prefetch buffers, allocator fragmentation: an assumption
DEFAULT_RESERVE = 3 * GiB


@dataclass(frozen=True)
class Setup:
    """The hardware and training choices a plan is made for. Memory in bytes."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory: int = 80 * GiB
    zero_stage: int | None = 3  # None under FSDP2
    offload_optimizer: bool = False
    offload_param: bool = False
    fsdp2: bool = False  # PyTorch FSDP2 (accelerate's fsdp_version: 2) instead of DeepSpeed; takes zero_stage=None
    fsdp_offload_params: bool = False  # FSDP2's CPUOffloadPolicy: parameters, gradients, optimizer states on CPU
    precision: str = "bf16"
    reference: str = "gpu"  # "gpu", "offload" (ref_offload=True) or "precompute" (precompute_ref_log_probs=True)
    tokens: int = 8192  # per micro-batch: chosen + rejected of all pairs, packed in one row
    context_parallel_size: int = 1  # GPUs sharing each row (context_parallel_size): each runs tokens / this many
    image_tokens: int = 0  # of the row's tokens, those a vision-language model's images take
    deal_images: bool = True  # deal_images: each GPU of a row encodes its share of the row's images (False: all)
    activation_checkpointing: bool = True
    reserve: int = DEFAULT_RESERVE
    cpu_memory: int | None = None  # per node; None: not checked
    zero_init: bool = True  # ZeRO-3 builds the model already partitioned (accelerate's zero3_init_flag)

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def engine(self) -> str:
        """What shards the model: "fsdp2", "deepspeed" (ZeRO-1 to 3) or "ddp" (stage 0, plain data parallelism)."""
        if self.fsdp2:
            return "fsdp2"
        return "deepspeed" if self.zero_stage else "ddp"
