"""The CUDA kernels that keep a packed row's sequences apart, each chosen explicitly and logged, and how tests run
those branches on a machine without CUDA.

Two kinds of kernels run a whole packed row on CUDA:

- attention: torch's `varlen_attn` (`padfree_varlen`, attention.py). torch 2.15 picks its backend itself, cuDNN
  before Flash for causal self-attention (SM90+, bf16/fp16, head dim <= 128, grouped heads too), and honours
  `sdpa_kernel`'s backend flags ("No viable backend" when the one it picks is disabled). Every call here runs on the
  Flash backend, chosen with `sdpa_kernel`: the one the GPU tests cover, whatever backends the user disabled. Flash
  needs SM80 or newer; older GPUs run the exact per-segment attention instead.
- stateful mixers of hybrid models (mixers.py): the functions transformers resolves when it imports a model's module
  (causal-conv1d, flash-linear-attention, mamba-ssm, or its own PyTorch fallbacks). A mixer runs its whole row through
  them only when every such function its forward calls takes the argument that keeps sequences apart (`seq_idx`,
  `cu_seqlens`), read from the resolved function itself: a function that swallows keywords (`**kwargs`), or
  transformers' PyTorch fallback, runs the mixer once per sequence instead.

Both choices are logged once per process (INFO, `trl_padfree.modeling.kernels`). One module per kind:
attention.py and mixers.py. Which kernels are in force is attention.py's `STAND_INS_IN_FORCE`: torch's and this
machine's, unless the architecture check's stand-in context (modeling/check/stand_ins.py) sets others.

`check.stand_ins.stand_in_kernels(...)` makes the packed forward take its CUDA branches on CPU tensors, with stand-in functions of the
kernels' real signatures in place of the real ones, refusing what they refuse (tests/support/stand_in_kernels.py): so the
branches that only run on a GPU are exercised by the CPU test suite against the kernels' real limits. The architecture
check's twin runs on the CPU path even then, as beside a real GPU (`cpu_twin_kernels`).
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def log_once(message: str, level: int = logging.INFO) -> None:
    # Kernels run in every layer of every step: say which one runs once per process, not per call
    logger.log(level, message)
