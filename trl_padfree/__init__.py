"""Padding-free DPO for TRL: `from trl_padfree import DPOConfig, DPOTrainer` is a swap-in for `from trl import ...`."""

from ._compat import check_trl_version

check_trl_version()

from .config import DPOConfig  # noqa: E402
from .modeling.attention import ATTN_IMPLEMENTATION  # noqa: E402  (importing it registers `padfree_varlen`)
from .packing.collator import PaddingFreePreferenceCollator, concatenated_inputs  # noqa: E402
from .trainer import DPOTrainer  # noqa: E402

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DPOConfig",
    "DPOTrainer",
    "PaddingFreePreferenceCollator",
    "concatenated_inputs",
]
__version__ = "0.1.0"
