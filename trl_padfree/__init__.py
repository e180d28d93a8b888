"""Padding-free DPO for TRL: `from trl_padfree import DPOConfig, DPOTrainer` is a swap-in for `from trl import ...`.

Each name below is imported when first used, so that `trl-padfree --help` and the light subcommands start without TRL's
trainer. `padfree_varlen` is registered with transformers when `DPOTrainer` (or `ATTN_IMPLEMENTATION`) is imported.
"""

import importlib

from ._compat import check_trl_version

check_trl_version()

# Each public name, and the module that defines it
_EXPORTS = {
    "ATTN_IMPLEMENTATION": ".modeling.attention",
    "DPOConfig": ".config",
    "DPOTrainer": ".trainer",
    "PaddingFreePreferenceCollator": ".packing.collator",
    "concatenated_inputs": ".packing.collator",
    "pair_scored_completions": ".data.scored_pairs",
    "pair_ultrafeedback": ".data.scored_pairs",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
