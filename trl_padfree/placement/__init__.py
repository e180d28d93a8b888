"""Where the frozen reference model lives: DeepSpeed ZeRO-3 with its parameters offloaded (deepspeed.py), FSDP2 a unit
per layer (fsdp2.py); the trainer's object for it is features/reference_placement.py."""
