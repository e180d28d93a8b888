"""`--count-collectives`: what each training step asks of torch.distributed on this process, counted by wrapping its
functions (every caller, accelerate's and DeepSpeed's included, looks them up on the module at each call), and the
host reads (tests/support/host_reads.py) made by trl-padfree's split-row code (parallel/). A step is the interval from one
`on_step_end` to the next: the micro-batches fetched for it, forwards, loss, backward, optimizer step."""

from __future__ import annotations

import functools
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for host_reads
from host_reads import HostReads  # noqa: E402

OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                      "send_object_list", "recv_object_list")  # fmt: skip
TENSOR_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                      "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "all_to_all",
                      "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier")  # fmt: skip


def _caller() -> str:
    """The innermost trl-padfree module on the stack ("parallel/groups.py"), else "others" (accelerate, DeepSpeed)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "trl_padfree" in frame.filename:
            return "/".join(Path(frame.filename).parts[-2:])
    return "others"


class StepCollectives(TrainerCallback):
    def __init__(self):
        self.steps: list[dict] = []
        self.current: Counter[str] = Counter()
        self.reads: HostReads | None = None
        self.originals: dict = {}
        self.depth = [0]  # an object collective runs tensor collectives inside: counted once, as itself

    def on_train_begin(self, args, state, control, **kwargs):
        for name in (*OBJECT_COLLECTIVES, *TENSOR_COLLECTIVES):
            if hasattr(dist, name):
                self.originals[name] = getattr(dist, name)
                setattr(dist, name, self._counted(name, self.originals[name]))
        self._start()

    def _counted(self, name, function):
        @functools.wraps(function)
        def counted(*args, **kwargs):
            if not self.depth[0]:
                self.current[name] += 1
                self.callers[f"{name} {_caller()}"] += 1
            self.depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.depth[0] -= 1

        return counted

    def _start(self):
        self.current = Counter()
        self.callers = Counter()
        self.reads = HostReads()
        self.reads.__enter__()

    def _finish(self):
        self.reads.__exit__(None, None, None)
        split_row_reads = {where: n for where, n in self.reads.where.items() if where.startswith("parallel/")}
        self.steps.append({
            "object": sum(self.current[name] for name in OBJECT_COLLECTIVES),
            "tensor": sum(self.current[name] for name in TENSOR_COLLECTIVES),
            "by_name": dict(self.current),
            "by_caller": dict(self.callers),
            "split_row_host_reads": sum(split_row_reads.values()),
            "split_row_host_reads_where": split_row_reads,
        })  # fmt: skip

    def on_step_end(self, args, state, control, **kwargs):
        self._finish()
        self._start()

    def on_train_end(self, args, state, control, **kwargs):
        self.reads.__exit__(None, None, None)
        for name, function in self.originals.items():
            setattr(dist, name, function)
