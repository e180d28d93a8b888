"""Packed rows: their layout (layout.py, pure), the collator that builds them (collator.py), prefix sharing's layout
(prefix_sharing.py), token-budget batches (token_budget.py), balanced batches (balanced_batches.py) and the partition
of a global batch across processes by cost (balance.py)."""
