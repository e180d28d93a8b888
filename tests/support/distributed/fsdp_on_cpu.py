"""Run a training script with accelerate's FSDP2 path on CPU processes over gloo, for the tests:

    accelerate launch --config_file trl_padfree/cli/accelerate_configs/fsdp2.yaml tests/support/distributed/fsdp_on_cpu.py SCRIPT ARGS

accelerate picks the distributed type from the device: on CPU processes it is MULTI_CPU, and only the multi-device
types (MULTI_GPU and its kin) become FSDP, so an FSDP config on CPU trains as plain DDP (accelerate/state.py,
`AcceleratorState.__init__`). PyTorch's FSDP2 itself runs on CPU tensors over gloo. So this reports MULTI_GPU with the
gloo backend and the CPU as the device, and opens the gloo process group itself (accelerate opens it only on its
MULTI_CPU path). Everything after that is accelerate's, TRL's and this package's own code: the FSDP plugin,
`fully_shard` of the policy, the reference's sharding. The tests assert DTensor parameters, so if accelerate stops
taking this route they fail instead of passing on DDP.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch


def install() -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")  # from torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT
        return "gloo", DistributedType.MULTI_GPU

    PartialState._prepare_backend = prepare_backend
    # PartialState's device, instead of the CUDA device MULTI_GPU implies
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"


if __name__ == "__main__":
    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]  # as if SCRIPT had been launched itself
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
