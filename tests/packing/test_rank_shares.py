"""Dynamic context parallelism's plan (packing/rank_shares.py) and its cost model (costs/context_parallel.py), on
plain numbers: micro-steps tile every rank with rows on aligned blocks within the budget, packed about as tightly as
whole rows, the sampler deals each process its block's row, and a chunk's work adds up to the row's."""

import functools
import itertools
import random

import pytest
import torch

from trl_padfree.costs.context_parallel import (
    INFINIBAND,
    NVLINK,
    Link,
    chunk_works,
    gathered_bytes,
    split_row_cost,
)
from trl_padfree.costs.flops import (
    BatchWork,
    DecoderShape,
    Segment,
    forward_flops,
    packed_row_work,
    training_step_flops,
)
from trl_padfree.packing.rank_shares import (
    ROW_RANKS,
    RowRanksCollator,
    RowRanksDataset,
    RowsOnRanksSampler,
    UnitWork,
    pack_micro_steps,
    rank_sizes,
    split_micro_steps_to_multiple,
)
from trl_padfree.packing.token_budget import pack_window
from trl_padfree.packing.units import PairUnits

SHAPE = DecoderShape(
    linear_params=10**8, hidden_size=512, vocab_size=32000, attention_layers=8, num_attention_heads=8, head_dim=64,
    num_key_value_heads=2,
)  # fmt: skip
RANKS, BUDGET = 8, 8 * 1024  # 1024 tokens a rank


def capacity(ranks: int) -> int:
    return ranks * BUDGET // RANKS


def row_cost(units, ranks: int, link: Link = NVLINK) -> float:
    segments = [segment for unit in units for segment in unit.segments]
    tokens = -(-sum(unit.tokens for unit in units) // RANKS) * RANKS
    return split_row_cost(SHAPE, segments, sum(unit.scored_tokens for unit in units), tokens, ranks, link)


def pair(chosen: int, rejected: int) -> UnitWork:
    return UnitWork(chosen + rejected, (Segment(chosen), Segment(rejected)), (chosen + rejected) // 2)


def long_tailed(seed: int, count: int = 200) -> list[UnitWork]:
    """Pairs of 60 to 8000 tokens, most of them short."""
    generator = random.Random(seed)
    sizes = [min(8000, int(generator.lognormvariate(5.5, 1.1)) + 60) for _ in range(count)]
    return [pair(size // 2, size - size // 2) for size in sizes]


@pytest.mark.parametrize("seed", range(6))
def test_micro_steps_tile_every_rank_on_aligned_blocks_within_the_budget(seed):
    units = long_tailed(seed)
    micro_steps = pack_micro_steps(units, RANKS, capacity, row_cost)
    assert sorted(unit for step in micro_steps for share in step for unit in share.units) == list(range(len(units)))
    for step in micro_steps:
        ranks = [rank for share in step for rank in range(share.first_rank, share.first_rank + share.ranks)]
        assert ranks == list(range(RANKS))  # each rank exactly once, in order
        for share in step:
            assert share.ranks in rank_sizes(RANKS) and share.first_rank % share.ranks == 0
            assert sum(units[unit].tokens for unit in share.units) <= capacity(share.ranks)
    # Packed about as tightly as the budget packs whole rows: no more micro-steps than 5% over the tokens' minimum;
    # never dearer than those whole rows by the cost model
    whole_rows = pack_window(range(len(units)), [unit.tokens for unit in units], capacity(RANKS))
    static = sum(row_cost([units[unit] for unit in row], RANKS) for row in whole_rows)
    cost = sum(max(row_cost([units[u] for u in share.units], share.ranks) for share in step) for step in micro_steps)
    assert cost <= static
    assert len(micro_steps) <= 1.05 * sum(unit.tokens for unit in units) / capacity(RANKS) + 1
    assert pack_micro_steps(units, RANKS, capacity, row_cost) == micro_steps  # deterministic


def across_nodes(units, ranks: int) -> float:
    """The cost over InfiniBand: gathering is dear, so the cost model prefers splitting less."""
    return row_cost(units, ranks, INFINIBAND)


def test_short_pairs_run_alone_and_a_long_one_takes_the_ranks_it_needs():
    units = [pair(1700, 1900), *[pair(150, 200) for _ in range(8)]]  # 3600 tokens: 4 ranks of 1024
    (step,) = pack_micro_steps(units, RANKS, capacity, across_nodes)
    (long,) = [share for share in step if 0 in share.units]
    assert long.ranks == 4 and long.first_rank == 0
    assert all(share.ranks == 1 for share in step if share is not long)
    # Two short pairs a rank: 8 of them on 4 ranks, nothing left over
    assert sorted(len(share.units) for share in step if share is not long) == [2, 2, 2, 2]


def test_the_static_split_where_the_cost_model_finds_it_cheaper():
    # Over NVLink this small model's micro-step, full to the budget, is cheapest split evenly over all ranks: fewer
    # tokens on the slowest rank, and gathering costs little
    units = [pair(1700, 1900), *[pair(150, 200) for _ in range(8)]]
    assert [(share.first_rank, share.ranks) for step in pack_micro_steps(units, RANKS, capacity, row_cost) for share
            in step] == [(0, RANKS)]  # fmt: skip
    # Pairs a little over a rank's budget: blocks of 2 hold one each, while whole rows of 4 ranks hold 3
    units = [pair(600, 600) for _ in range(12)]
    micro_steps = pack_micro_steps(units, 4, lambda ranks: ranks * 1024, across_nodes)
    assert [[(share.first_rank, share.ranks) for share in step] for step in micro_steps] == [[(0, 4)]] * 4


def test_free_ranks_go_to_the_dearest_rows_and_a_single_pair_fills_the_group():
    (step,) = pack_micro_steps([pair(40, 30)], RANKS, capacity, row_cost)
    assert [(share.first_rank, share.ranks) for share in step] == [(0, RANKS)]
    # Gathered bytes priced high: fewer are gathered doubling the dearest rows into the free ranks than splitting
    # the three pairs' one row over all 8
    bytes_dear = functools.partial(row_cost, link=Link(byte_flops=1e9, exchange_flops=0.0))
    (step,) = pack_micro_steps([pair(400, 400), pair(50, 50), pair(60, 60)], RANKS, capacity, bytes_dear)
    assert [(share.units, share.ranks) for share in step] == [((0,), 4), ((2,), 2), ((1,), 2)]
    with pytest.raises(ValueError, match="A unit of 10000 tokens does not fit 8 ranks"):
        pack_micro_steps([pair(5000, 5000)], RANKS, capacity, row_cost)


def test_micro_steps_split_to_a_multiple_of_the_groups():
    units = long_tailed(0, count=30)
    micro_steps = pack_micro_steps(units, RANKS, capacity, row_cost)
    for groups in (2, 3, 7):
        split = split_micro_steps_to_multiple(micro_steps, groups, RANKS, units, row_cost)
        assert len(split) % groups == 0
        assert sorted(unit for step in split for share in step for unit in share.units) == list(range(len(units)))
        for step in split:
            assert sorted(
                r for share in step for r in range(share.first_rank, share.first_rank + share.ranks)
            ) == list(range(RANKS))
            assert all(sum(units[unit].tokens for unit in share.units) <= capacity(share.ranks) for share in step)


def test_chunk_works_add_up_to_the_row_and_later_chunks_cost_more():
    segments = [Segment(700), Segment(300, prefix=200), Segment(33)]
    row_tokens = 1040  # 1033 tokens and 7 of padding
    for ranks in (1, 2, 4, 8):
        works = chunk_works(segments, 500, row_tokens, ranks)
        total = sum(works, BatchWork())
        whole = packed_row_work(segments, 500, row_tokens)
        assert (total.tokens, total.attention_pairs) == (whole.tokens, whole.attention_pairs)
        assert abs(total.scored_tokens - 500) < ranks  # shared out by tokens, rounded down per chunk
    one_sequence = chunk_works([Segment(1024)], 0, 1024, 4)
    assert [work.attention_pairs for work in one_sequence] == sorted(work.attention_pairs for work in one_sequence)


def test_a_row_alone_gathers_nothing_and_a_split_row_pays_its_bytes_and_exchanges():
    segments = [Segment(1024)]
    alone = split_row_cost(SHAPE, segments, 0, 1024, 1, NVLINK)
    assert alone == training_step_flops(SHAPE, packed_row_work(segments, 0))
    # kv heads x (key + value) x head dim x 2 bytes x 3 exchanges x layers, for the other ranks' tokens
    assert gathered_bytes(SHAPE, 1024, 4) == 768 * 2 * 2 * 64 * 2 * 3 * 8
    free = Link(byte_flops=0.0, exchange_flops=0.0)
    compute = split_row_cost(SHAPE, segments, 0, 1024, 4, free)
    assert split_row_cost(SHAPE, segments, 0, 1024, 4, Link(1.0, 0.0)) == compute + gathered_bytes(SHAPE, 1024, 4)
    assert split_row_cost(SHAPE, segments, 0, 1024, 4, Link(0.0, 5.0)) == compute + 5.0 * 3 * 8
    # Activation checkpointing: a fourth exchange a layer and the policy's forward again
    recomputed = split_row_cost(SHAPE, segments, 0, 1024, 4, Link(0.0, 5.0), recompute=True)
    forward = forward_flops(SHAPE, chunk_works(segments, 0, 1024, 4)[-1])
    assert recomputed == pytest.approx(compute + forward + 5.0 * 4 * 8)
    # The reference precomputed: two exchanges a layer
    assert split_row_cost(SHAPE, segments, 0, 1024, 4, Link(0.0, 5.0), reference_forward=False) == pytest.approx(
        split_row_cost(SHAPE, segments, 0, 1024, 4, free, reference_forward=False) + 5.0 * 2 * 8
    )


def test_the_sampler_deals_each_process_its_blocks_row_then_the_marker():
    lengths = [3000, 200, 150, 220, 180, 900, 800, 100, 120, 130, 140, 60, 1900, 2500]
    works = {index: pair(length // 2, length - length // 2) for index, length in enumerate(lengths)}
    sampler = RowsOnRanksSampler(
        PairUnits(lengths), lambda pairs: works[pairs[0]], pairs=len(lengths), processes=4, ranks=2,
        capacity=lambda ranks: ranks * 2048, row_cost=row_cost, seed=0, window=1000,
    )  # fmt: skip
    sampler.set_epoch(3)
    dealt = list(sampler)
    steps = list(sampler.epoch_micro_steps())
    assert len(dealt) == len(sampler) == 4 * len(steps)  # every micro-step: one list per process
    assert sorted(pair for groups in steps for rows in groups for pairs, _ in rows for pair in pairs) == list(
        range(len(lengths))
    )
    for number, groups in enumerate(steps):
        assert len(groups) == 2  # two groups of two ranks
        lists = dealt[4 * number : 4 * number + 4]
        for group, rows in enumerate(groups):
            for pairs, share in rows:
                for rank in range(share.first_rank, share.first_rank + share.ranks):
                    assert lists[2 * group + rank] == [*pairs, len(lengths) + share.ranks]
    assert sum(sampler.rows_by_ranks().values()) == sum(len(rows) for groups in steps for rows in groups)
    sampler.set_epoch(4)
    assert list(sampler.epoch_micro_steps()) != steps  # a new order each epoch, the same micro-steps
    rows = sorted(str(rows) for groups in steps for rows in groups)
    assert sorted(str(rows) for groups in sampler.epoch_micro_steps() for rows in groups) == rows


def test_prompt_group_pieces_stay_in_one_row():
    units = PairUnits.by_group_id([0, 0, 1, 1, 1, 2], sizes=[200] * 6)
    sampler = RowsOnRanksSampler(
        units, lambda pairs: UnitWork(200 * len(pairs), tuple(Segment(100) for _ in range(2 * len(pairs))), 100),
        pairs=6, processes=2, ranks=2, capacity=lambda ranks: ranks * 700, row_cost=row_cost, seed=0, window=1000,
    )  # fmt: skip
    rows = [pairs for groups in sampler.epoch_micro_steps() for rows in groups for pairs, _ in rows]
    for group in ([0, 1], [2, 3, 4], [5]):
        assert sum(set(group) <= set(pairs) for pairs in rows) == 1


def test_the_dataset_and_collator_carry_the_rows_ranks():
    examples = [{"x": index} for index in range(5)]
    dataset = RowRanksDataset(examples)
    assert len(dataset) == 5 and dataset[2] == {"x": 2} and dataset[5 + 4] == {ROW_RANKS: 4}
    fetched = dataset.__getitems__([3, 1, 5 + 2])
    assert fetched == [{"x": 3}, {"x": 1}, {ROW_RANKS: 2}]
    collate = RowRanksCollator(lambda rows: {"x": torch.tensor([row["x"] for row in rows])})
    batch = collate(fetched)
    assert batch[ROW_RANKS] == 2 and batch["x"].tolist() == [3, 1]


def test_rank_sizes_double_up_to_the_group():
    assert rank_sizes(1) == (1,) and rank_sizes(8) == (1, 2, 4, 8)
    assert list(itertools.accumulate(rank_sizes(16)[1:], lambda a, b: b)) == [2, 4, 8, 16]
