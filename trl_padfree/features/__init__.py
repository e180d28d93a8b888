"""The trainer's features, one object each with its phases around TRL's `__init__` and its part of a step
(trainer.py wires them). They drive the mechanisms below them: packing/, parallel/, placement/, modeling/."""

from .batches import BatchPlan
from .padding_free import PaddingFree
from .pair_weighted_steps import PairWeightedSteps
from .reference_placement import ReferencePlacement
from .row_split import RowSplit

__all__ = ["BatchPlan", "PaddingFree", "PairWeightedSteps", "ReferencePlacement", "RowSplit"]
