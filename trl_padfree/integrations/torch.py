"""torch's private names trl-padfree relies on: the wrapper `torch.compile` puts around a module
(`torch._dynamo.eval_frame.OptimizedModule`) and the module it holds (`_orig_mod`). Under
`TrainingArguments(torch_compile=True)` accelerate wraps the models it prepares so, and whether a model packs is
decided on the class under the wrapper."""

from __future__ import annotations

import torch
from torch._dynamo.eval_frame import OptimizedModule


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether `model` is the wrapper `torch.compile(module)` returns."""
    return isinstance(model, OptimizedModule)


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module under `torch.compile`'s wrapper (under each, if compiled twice), or `model` itself."""
    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model
