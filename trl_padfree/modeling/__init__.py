"""How a model runs a packed row, in a step: its attention (attention/, backends.py, kernels/attention.py), its
stateful mixers (mixers.py, kernels/mixers.py), the packed forward (packed_forward.py, packed_batch.py), images
(vision.py, families/) and TRL's fused LM head (fused_lm_head.py). What decides before training whether a model packs
is check/ (`check.packability.verify_packable`)."""
