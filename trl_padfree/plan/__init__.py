"""`trl-padfree plan`: will a DPO run fit in GPU memory, and if not, what is the cheapest change that makes it fit.

From the model's config alone (no weights), `memory` adds up per GPU the policy states, the reference model, the
activations and a reserve, and per node the CPU memory (DeepSpeed's estimators, or `fsdp2` for PyTorch FSDP2);
`search` finds the cheapest change that fits, `report` prints the plan and `command` is the command line. Formulas, assumptions and what is not modelled: docs/concepts/memory-planning.md.
"""

from .command import add_arguments, run
from .memory import (
    activation_memory,
    estimate,
    layer_activation_bytes_per_token,
    policy_states,
    reference_memory,
)
from .search import cheapest_fix
from .setup import Setup
from .shapes import ModelShape, load_model_shape, shape_of_config
from .units import GiB, parse_count, parse_memory

__all__ = [
    "GiB",
    "ModelShape",
    "Setup",
    "activation_memory",
    "add_arguments",
    "cheapest_fix",
    "estimate",
    "layer_activation_bytes_per_token",
    "load_model_shape",
    "parse_count",
    "parse_memory",
    "policy_states",
    "reference_memory",
    "run",
    "shape_of_config",
]
