"""Padding-free DPO for TRL: `from trl_padfree import DPOConfig, DPOTrainer` is a swap-in for `from trl import ...`."""

from ._compat import check_trl_version

check_trl_version()

from . import attention  # noqa: E402  (registers the `padfree_varlen` attention with transformers)
from .attention import ATTN_IMPLEMENTATION  # noqa: E402
from .collator import PaddingFreePreferenceCollator, PreferenceCollator, concatenated_inputs  # noqa: E402

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PaddingFreePreferenceCollator",
    "PreferenceCollator",
    "attention",
    "concatenated_inputs",
]
__version__ = "0.1.0"
