"""Where the frozen reference model lives: the trainer's object for it (reference.py), DeepSpeed ZeRO-3 with its
parameters offloaded (deepspeed.py), FSDP2 a unit per layer (fsdp2.py)."""
