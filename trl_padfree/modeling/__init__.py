"""How a model runs a packed row: its attention (attention/, backends.py, kernels.py), its stateful mixers
(mixers.py), the packed forward (packed_forward.py), TRL's fused LM head (fused_lm_head.py), and whether an
architecture packs exactly (packability.py)."""
