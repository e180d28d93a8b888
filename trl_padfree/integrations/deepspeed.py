"""DeepSpeed's private names trl-padfree relies on: whether this process already set up Ulysses' sequence-parallel
groups (`parallel_state_sp._SEQUENCE_PARALLEL_GROUP`: the public getter only asserts, and the assert is gone under
`python -O`)."""

from __future__ import annotations


def sequence_parallel_groups_created() -> bool:
    """Whether DeepSpeed has created its sequence-parallel groups in this process (it does so once per process)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None


def sequence_parallel_group():
    """(group, rank in it, its size) of this process's sequence-parallel group, once DeepSpeed created it."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return (
        parallel_state_sp.get_sequence_parallel_group(),
        parallel_state_sp.get_sequence_parallel_rank(),
        parallel_state_sp.get_sequence_parallel_world_size(),
    )
