"""Packed rows: their layout (layout.py, pure), the collator that builds them (collator.py), prefix sharing's layout
(prefix_sharing.py) and token-budget batching (token_budget.py)."""
