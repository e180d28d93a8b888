"""Packed rows: their layout (layout.py, pure), the collator that builds them (collator.py), prefix sharing's layout
(prefix_sharing.py), token-budget batching (token_budget.py) and the partition of a global batch across processes by
cost (balance.py)."""
