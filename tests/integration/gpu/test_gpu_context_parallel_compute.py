"""tools/measure/gpu_context_parallel_compute.py's plain-integer parts: the chunks a row is cut into, the pairs both
layouts pack, and the cost model's compute of a micro-step (the GPU report's dry run runs the rest)."""

from tools.measure.gpu_context_parallel_compute import (
    DRY_RUN_PLAN,
    GPU_PLAN,
    chunk_layouts,
    draw_pairs,
    micro_step_flops,
)
from trl_padfree.cli.context_parallel_balance import GroupBudget, dynamic_layout, pair_unit, static_layout
from trl_padfree.costs.context_parallel import chunk_works
from trl_padfree.costs.flops import DecoderShape, Segment, forward_flops, training_step_flops

SHAPE = DecoderShape(
    linear_params=1000, hidden_size=8, vocab_size=50, attention_layers=2, num_attention_heads=2, head_dim=4
)


def test_a_row_is_cut_into_its_ranks_chunks_with_positions_and_completions():
    # Pairs (prompt, chosen, rejected) = (3, 1, 2), (1, 1, 1): segments of 4, 5, 2, 2 tokens, then 3 of padding
    #   row        | p p p c | p p p r r | p c | p r | pad pad pad |
    #   positions  0 1 2 3   0 1 2 3 4   0 1   0 1   0   1   2
    chunks = chunk_layouts([(3, 1, 2), (1, 1, 1)], padded_length=16, ranks=4)
    assert {chunk.bounds for chunk in chunks} == {(0, 4, 9, 11, 13, 16)}
    assert [chunk.chunk for chunk in chunks] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    positions = [position for chunk in chunks for position in chunk.position_ids]
    assert positions == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 0, 1, 0, 1, 2]
    # Completion tokens: row positions 3, 7, 8, 10, 12
    assert [chunk.scored for chunk in chunks] == [(3,), (3,), (0, 2), (0,)]
    (alone,) = chunk_layouts([(3, 1, 2)], padded_length=9, ranks=1)  # one rank: the whole row, no padding needed
    assert alone.bounds == (0, 4, 9) and alone.chunk == (0, 9) and alone.scored == (3, 7, 8)


def test_both_layouts_train_every_drawn_pair_once_within_the_rank_budget():
    for plan in (DRY_RUN_PLAN, GPU_PLAN):
        pairs = draw_pairs(plan)
        assert len(pairs) == plan.pairs and all(min(pair) >= 1 for pair in pairs)
        units = [pair_unit(*pair) for pair in pairs]
        budget = GroupBudget(SHAPE, plan.ranks, plan.rank_budget)
        for layout in (static_layout(units, budget), dynamic_layout(units, budget)):
            numbers = sorted(number for step in layout.members for row in step for number in row[0])
            assert numbers == list(range(plan.pairs)), layout.name
            for step in layout.members:
                for row, _, ranks in step:
                    padded = budget.padded(sum(units[number].tokens for number in row))
                    assert padded // ranks <= plan.rank_budget
                    chunks = chunk_layouts([pairs[number] for number in row], padded, ranks)
                    assert sum(len(chunk.scored) for chunk in chunks) == sum(units[n].scored_tokens for n in row)


def test_a_micro_steps_compute_is_its_slowest_chunk_at_a_free_link():
    pairs = [(3, 1, 2), (1, 1, 1), (2, 2, 2)]
    units = [pair_unit(*pair) for pair in pairs]
    budget = GroupBudget(SHAPE, ranks=4, rank_budget=8)

    def compute(work):  # a DPO step with activation checkpointing's second policy forward, as the trainer runs it
        return training_step_flops(SHAPE, work) + forward_flops(SHAPE, work)

    # Pairs 0 and 1 on ranks 0-1 (13 tokens, padded to a multiple of 4), pair 2 alone on rank 2
    segments = [Segment(4), Segment(5), Segment(2), Segment(2)]
    slowest = max(map(compute, chunk_works(segments, scored_tokens=5, row_tokens=16, ranks=2)))
    assert micro_step_flops(units, budget, [((0, 1), 0, 2)]) == slowest
    (alone,) = chunk_works([Segment(4), Segment(4)], scored_tokens=4, row_tokens=8, ranks=1)
    assert micro_step_flops(units, budget, [((0, 1), 0, 2), ((2,), 2, 1)]) == max(slowest, compute(alone))
