"""Balanced ranks: one optimizer step's pairs split so that every data-parallel process gets a row of about the same
cost, at every micro-step.

Once padding is gone, a process's row costs what its pairs cost, and pairs differ in length by 10x and more. Dealt
out as they come (`pairs_per_process` random pairs each), the processes' rows differ too, and every micro-step waits
for the most expensive one: on UltraFeedback-like lengths the slowest of 64 processes runs about 1.5x the mean.
Here the step's global batch is partitioned by cost instead:

    global batch (indices 0..n-1, costs from `pair_cost`)
        |  level 1: micro-steps of equal pair counts (+-1) and about equal cost
        v
    micro-step 0: [ ...pairs... ]      micro-step 1: [ ...pairs... ]      ...
        |  level 2: LPT across the processes
        v
    process 0 | process 1 | ... | process P-1        (each row: the same cost, within the LPT bound)

Pure arithmetic on plain numbers (no torch, no transformers): every process computes the same partition from the same
costs, with no communication and no randomness (ties go to the lower index).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ..costs.flops import DecoderShape, Segment, packed_row_work, training_step_flops
from .layout import HostRow


def pair_cost(
    shape: DecoderShape,
    chosen_len: int,
    rejected_len: int,
    scored_tokens: int,
    shared_prefix: int = 0,
    reference_forward: bool = True,
) -> float:
    """Training-step FLOPs a pair adds to a packed row (`costs/flops.py`'s model): both sequences through the linear
    layers, the LM head on the scored (completion) tokens, and causal attention within each sequence. With prefix
    sharing the rejected branch drops the `shared_prefix` tokens it shares and reads them instead::

        unshared   | p p p c c | p p p r r r |     chosen_len 5, rejected_len 6
        shared     | p p p c c |     p r r r |     shared_prefix 2: the rejected branch (4 tokens) reads p p

    A row's cost is the sum of its pairs' costs: every term is per token or per sequence.

    Args:
        shape (`DecoderShape`):
            The model's shape (`DecoderShape.from_config(config)`).
        chosen_len (`int`):
            Tokens of the truncated prompt + chosen sequence.
        rejected_len (`int`):
            Tokens of the truncated prompt + rejected sequence.
        scored_tokens (`int`):
            Completion tokens of both sequences, which the LM head scores.
        shared_prefix (`int`, *optional*, defaults to `0`):
            Prompt tokens the rejected branch reads from the chosen sequence instead of repeating
            (`packing.prefix_sharing.shared_prefix_length`); 0 lays the pair out unshared.
        reference_forward (`bool`, *optional*, defaults to `True`):
            Count the reference model's forward (False when reference log-probs are precomputed).

    Returns:
        `float`: the FLOPs of one training step on the pair.

    Example:

    ```python
    >>> shape = DecoderShape(linear_params=10, hidden_size=2, vocab_size=3, attention_layers=1,
    ...                      num_attention_heads=1, head_dim=1)
    >>> pair_cost(shape, chosen_len=3, rejected_len=2, scored_tokens=2)  # 4 forwards x 2 x (50 + 12 + 18)
    640.0
    >>> pair_cost(shape, chosen_len=3, rejected_len=2, scored_tokens=2, shared_prefix=1)  # 4 x 2 x (40 + 12 + 16)
    544.0

    ```
    """
    if min(chosen_len, rejected_len) < 1 or scored_tokens < 0:
        raise ValueError(
            f"A pair needs sequences of at least 1 token, got chosen {chosen_len}, rejected {rejected_len}."
        )
    if not 0 <= shared_prefix < min(chosen_len, rejected_len):
        raise ValueError(
            f"shared_prefix={shared_prefix} must be at least 0 and shorter than both sequences ({chosen_len}, "
            f"{rejected_len}): the rejected branch keeps at least one token of its own."
        )
    segments = [Segment(chosen_len), Segment(rejected_len - shared_prefix, prefix=shared_prefix)]
    work = packed_row_work(segments, scored_tokens)
    return float(training_step_flops(shape, work, reference_forward=reference_forward))


def row_cost(shape: DecoderShape, row: HostRow, reference_forward: bool = True) -> float:
    """Training-step FLOPs of a collated row, from its host integers: the sum of its pairs' `pair_cost`, as the
    collator laid them out (shared or not; a prompt group's sequences that read the same tokens counted once, so a
    grouped row costs less than its pairs). The trailing padding segment is left out: it is what the cost model
    counts for every layout alike, and a balanced step's rows differ in it by less than `pad_to_multiple_of`."""
    segments = [
        Segment(row.seq_lens[sequence] - row.prefix_lens[sequence], prefix=row.prefix_lens[sequence])
        for sequence in row.laid_out
    ]
    work = packed_row_work(segments, row.scored_tokens)
    return float(training_step_flops(shape, work, reference_forward=reference_forward))


def partition(costs: Sequence[float], processes: int, micro_steps: int = 1) -> list[list[list[int]]]:
    """Split one optimizer step's pairs (indices `0..n-1`) into `micro_steps` x `processes` bins so that at every
    micro-step the processes' rows cost about the same.

    Two levels:

    1. Micro-steps: pairs in decreasing cost, each to the cheapest micro-step that still has room, every micro-step
       holding `n // micro_steps` pairs or one more. Equal counts keep the micro-steps' memory alike and give each at
       least `processes` pairs, so every process has a row to run. The largest pairs spread over the micro-steps,
       so with a heavy tail each micro-step waits for its own largest pair (docs/concepts/balancing.md). A greedy split with
       no bound of its own: the bound below holds at each micro-step for the split it gets.
    2. Processes, per micro-step: LPT (longest processing time first, Graham 1969): pairs in decreasing cost, each to
       the process whose row costs least so far (ties: fewer pairs, then the lower process). The most expensive row
       costs at most (4/3 - 1/(3 x processes)) x the optimum of that micro-step, and at most
       `max(c[0], mean + (1 - 1/processes) x c[processes])`, with `c` the micro-step's costs sorted decreasing
       (from 0) and `mean` its row mean. LPT rather than Karmarkar-Karp's multi-way differencing: on 2048 pairs over
       512 processes KK took 70-80 ms per step in Python against LPT's 2-4 ms, and its rows were no better overall
       (equal on UltraFeedback-like lengths, better on Capybara-like ones at max_length 1024, worse at 2048;
       docs/concepts/balancing.md).

    Deterministic: the same costs give the same bins on every process (ties broken by index), with no randomness.

    Args:
        costs (`Sequence[float]`):
            Each pair's cost (`pair_cost`), non-negative.
        processes (`int`):
            Data-parallel processes.
        micro_steps (`int`, *optional*, defaults to `1`):
            Micro-steps per optimizer step (gradient accumulation steps).

    Returns:
        `list[list[list[int]]]`: `bins[micro_step][process]`, the indices of that row's pairs in increasing order;
        every index appears exactly once.

    Raises:
        `ValueError`: fewer pairs than `processes x micro_steps` (a process would have no row to run), or a negative
        or non-finite cost.

    Example:

    ```python
    >>> partition([5, 1, 4, 2, 3, 3], processes=2)  # rows of 5 + 3 + 1 and 4 + 3 + 2
    [[[0, 1, 5], [2, 3, 4]]]
    >>> partition([5, 1, 4, 2, 3, 3], processes=2, micro_steps=2)  # micro-steps of 5 | 3 + 1 and 4 | 3 + 2
    [[[0], [1, 5]], [[2], [3, 4]]]

    ```
    """
    check_partition_inputs(costs, processes, micro_steps)
    order = sorted(range(len(costs)), key=lambda index: (-costs[index], index))
    groups = _split_micro_steps(order, costs, micro_steps) if micro_steps > 1 else [order]
    return [_longest_processing_time(group, costs, processes) for group in groups]


def sorted_partition(costs: Sequence[float], processes: int, micro_steps: int) -> list[list[list[int]]]:
    """`partition`'s other level 1: micro-steps of neighbouring costs (the pairs sorted by decreasing cost and cut
    into `micro_steps` runs of `n // micro_steps` pairs or one more), then LPT across the processes. Where rows hold
    one or two pairs, spreading the largest pairs over the micro-steps (`partition`) leaves each micro-step waiting
    for one large pair among small ones; grouping them makes every row of that micro-step large alike.

    >>> sorted_partition([5, 1, 4, 2, 3, 3], processes=2, micro_steps=3)  # micro-steps 5 | 4, 3 + 3 | 2, 1
    [[[0], [2]], [[4], [5]], [[3], [1]]]
    """
    check_partition_inputs(costs, processes, micro_steps)
    order = sorted(range(len(costs)), key=lambda index: (-costs[index], index))
    least, extra = divmod(len(order), micro_steps)
    sizes = [least + (step < extra) for step in range(micro_steps)]
    groups = [order[sum(sizes[:step]) : sum(sizes[: step + 1])] for step in range(micro_steps)]
    return [_longest_processing_time(group, costs, processes) for group in groups]


def best_split(
    costs: Sequence[float],
    processes: int,
    micro_steps: int,
    dealt: Sequence[Sequence[Sequence[int]]] | None = None,
) -> list[list[list[int]]]:
    """The split a balanced step runs: of `partition`'s, `sorted_partition`'s and the rows as dealt (`dealt`,
    `bins[micro_step][process]` of indices into `costs`, when every row of it holds a pair), the one whose step is
    estimated shortest (`imbalance`), among those whose most expensive row costs no more than the dealt step's most
    expensive row (so no micro-step needs more memory than dealt as usual; without `dealt`, no such limit). Ties go
    to the first of that order.

    >>> best_split([1, 1, 1, 1, 9, 9, 9, 9], processes=4, micro_steps=2)  # the 9s together, then the 1s
    [[[4], [5], [6], [7]], [[0], [1], [2], [3]]]
    """
    candidates = [partition(costs, processes, micro_steps)]
    if micro_steps > 1:
        candidates.append(sorted_partition(costs, processes, micro_steps))
    dealt_whole = dealt is not None and all(row for step in dealt for row in step)
    if dealt_whole:
        candidates.append([[list(row) for row in step] for step in dealt])
    priced = [(bins, bin_costs(costs, bins)) for bins in candidates]  # each row's cost, once per candidate
    limit = max(max(step) for step in priced[-1][1]) if dealt_whole else math.inf  # the dealt step's costliest row
    allowed = [(bins, rows) for bins, rows in priced if max(max(step) for step in rows) <= limit]
    return min(allowed, key=lambda candidate: imbalance(candidate[1]))[0]


def check_partition_inputs(costs: Sequence[float], processes: int, micro_steps: int) -> None:
    """Refuse what `partition` cannot split so that every process runs a row at every micro-step."""
    if processes < 1 or micro_steps < 1:
        raise ValueError(f"processes ({processes}) and micro_steps ({micro_steps}) must be at least 1.")
    if len(costs) < processes * micro_steps:
        raise ValueError(
            f"A global batch of {len(costs)} pairs cannot give each of {processes} processes a pair at each of "
            f"{micro_steps} micro-steps: a process with no pair has no row to run. Use at least "
            f"{processes * micro_steps} pairs per optimizer step (per_device_train_batch_size >= 1), or fewer "
            "processes or gradient accumulation steps."
        )
    bad = next((index for index, cost in enumerate(costs) if not (math.isfinite(cost) and cost >= 0)), None)
    if bad is not None:
        raise ValueError(f"Pair costs must be finite and non-negative; pair {bad} costs {costs[bad]}.")


def _split_micro_steps(order: list[int], costs: Sequence[float], micro_steps: int) -> list[list[int]]:
    """Level 1: pairs in `order` (decreasing cost), each to the cheapest micro-step with room (ties: fewer pairs, then
    the lower micro-step); micro-steps hold `n // micro_steps` pairs, `n % micro_steps` of them one more. Each group
    keeps `order`."""
    least, extra = divmod(len(order), micro_steps)
    groups: list[list[int]] = [[] for _ in range(micro_steps)]
    heap = [(0.0, 0, step) for step in range(micro_steps)]  # the micro-steps with room: (cost so far, pairs, step)
    fuller = 0  # micro-steps holding `least + 1` pairs: at most `extra`
    for index in order:
        load, count, step = heapq.heappop(heap)
        while count == least and fuller == extra:  # full: no micro-step may hold one more pair any longer
            load, count, step = heapq.heappop(heap)
        groups[step].append(index)
        if count + 1 <= least:
            heapq.heappush(heap, (load + costs[index], count + 1, step))
        else:  # it now holds one more than `least`: full
            fuller += 1
    return groups


def _longest_processing_time(group: list[int], costs: Sequence[float], processes: int) -> list[list[int]]:
    """Level 2: LPT over `group` (decreasing cost): each pair to the cheapest row so far; ties go to the row with
    fewer pairs (so a zero-cost pair never leaves a process empty), then to the lower process."""
    rows: list[list[int]] = [[] for _ in range(processes)]
    heap = [(0.0, 0, process) for process in range(processes)]  # (cost so far, pairs, process): already a heap
    for index in group:
        load, count, process = heap[0]
        rows[process].append(index)
        heapq.heapreplace(heap, (load + costs[index], count + 1, process))
    return [sorted(row) for row in rows]


def row_cost_lower_bound(costs: Sequence[float], rows: int) -> float:
    """A cost the most expensive of `rows` rows reaches however the pairs are split: the mean row, and for every
    k >= 0 the k + 1 cheapest of the k x rows + 1 most expensive pairs (some row holds k + 1 of them: pigeonhole;
    k = 0 is the largest pair). What `partition`'s rows are measured against.

    >>> row_cost_lower_bound([4, 3, 3, 1, 1], rows=2)  # a row holds 2 of the 3 largest: at least 3 + 3
    6.0
    >>> row_cost_lower_bound([2, 2, 2, 2], rows=3)  # the mean is 8/3, yet a row holds two pairs
    4.0
    """
    ordered = sorted(costs, reverse=True)
    prefix_sums = [0.0]
    for cost in ordered:
        prefix_sums.append(prefix_sums[-1] + cost)
    bound = prefix_sums[-1] / rows
    for k in range((len(ordered) - 1) // rows + 1):
        first, last = k * rows - k, k * rows  # the k + 1 cheapest of the k x rows + 1 largest, positions first..last
        bound = max(bound, prefix_sums[last + 1] - prefix_sums[first])
    return float(bound)


def bin_costs(costs: Sequence[float], bins: Sequence[Sequence[Sequence[int]]]) -> list[list[float]]:
    """The cost of every row of `bins[micro_step][process]` (pair indices into `costs`).

    >>> bin_costs([5, 1, 4, 2, 3, 3], [[[0], [1, 5]], [[2], [3, 4]]])
    [[5.0, 4.0], [4.0, 5.0]]
    """
    return [[float(sum(costs[index] for index in row)) for row in step] for step in bins]


def imbalance(step_costs: Sequence[Sequence[float]]) -> float:
    """How much longer an optimizer step takes than with perfectly equal processes, if a row's time is proportional
    to its cost: each micro-step waits for its slowest process, so

        imbalance = sum over micro-steps of max over processes / sum over micro-steps of mean over processes

    With one micro-step, the most expensive row over the mean row (1.0: balanced). With several, the micro-steps'
    max / mean ratios averaged with the micro-steps' costs as weights: the ratio of step times.

    Args:
        step_costs (`Sequence[Sequence[float]]`):
            `step_costs[micro_step][process]`, each row's cost (`bin_costs`).

    Example:

    ```python
    >>> imbalance([[5.0, 4.0], [4.0, 5.0]])  # (5 + 5) / (4.5 + 4.5)
    1.1111111111111112
    >>> imbalance([[9.0, 9.0]])
    1.0

    ```
    """
    slowest = sum(max(step) for step in step_costs)
    mean = sum(sum(step) / len(step) for step in step_costs)
    if not mean > 0:
        raise ValueError("imbalance needs rows of positive total cost.")
    return slowest / mean
