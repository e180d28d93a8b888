"""The trainer's features, one object each with its phases around TRL's `__init__` and its part of a step
(trainer.py wires them). They drive the mechanisms below them: packing/, parallel/, placement/, modeling/."""

from .balanced_batches import BalancedBatches
from .padding_free import PaddingFree
from .pair_weighted_steps import PairWeightedSteps
from .prompt_group_batches import PromptGroupBatches
from .reference_placement import ReferencePlacement
from .row_split import RowSplit
from .token_budget_batching import TokenBudgetBatching

__all__ = [
    "BalancedBatches",
    "PaddingFree",
    "PairWeightedSteps",
    "PromptGroupBatches",
    "ReferencePlacement",
    "RowSplit",
    "TokenBudgetBatching",
]
