"""The arithmetic of tools/measure/measure_dynamic_context_parallel.py on hand-made reports: the pairs it draws, the
link it fits, and what it makes of each run's steps (no launch, no timing)."""

import functools

import pytest

from tools.measure.measure_dynamic_context_parallel import (
    calibrated_links,
    compare,
    draw_pair_lengths,
    fit_line,
    summarize,
)
from trl_padfree.costs.context_parallel import gathered_bytes, split_row_cost
from trl_padfree.costs.flops import DecoderShape, Segment
from trl_padfree.data.length_models import REASONING

SHAPE = DecoderShape(linear_params=1000, hidden_size=8, vocab_size=32, attention_layers=2, num_attention_heads=2,
                     head_dim=4, num_key_value_heads=1)  # fmt: skip


def test_drawn_pairs_are_seeded_and_fit_the_cap():
    drawn = draw_pair_lengths(REASONING, 1 / 8, pairs=300, pair_cap=1000, seed=3)
    assert drawn == draw_pair_lengths(REASONING, 1 / 8, pairs=300, pair_cap=1000, seed=3)
    totals = [2 * pair["prompt"] + pair["chosen"] + pair["rejected"] for pair in drawn]
    assert max(totals) <= 1000 and min(min(pair.values()) for pair in drawn) >= 1
    assert sum(total == max(totals) for total in totals) < len(totals) // 4  # a tail, not a wall at the cap


def test_the_link_is_a_line_through_the_slowest_process():
    assert fit_line([(0, 1.0), (10, 3.0), (20, 5.0)]) == pytest.approx((1.0, 0.2))
    gathers = [{"received_bytes": size, "seconds": 0.001 + size / 1e9} for size in (1000, 10_000, 100_000)]
    slower = [{"received_bytes": point["received_bytes"], "seconds": 2 * point["seconds"]} for point in gathers]
    calibration = {
        "processes": [
            {"matmul_flops": 4e9, "matmul_wall_seconds": 2.0, "matmul_thread_seconds": 1.0, "gathers": {"2": gathers}},
            {"matmul_flops": 4e9, "matmul_wall_seconds": 2.0, "matmul_thread_seconds": 1.0, "gathers": {"2": slower}},
        ]
    }
    links = calibrated_links(calibration)
    assert links["flops_per_second_wall"] == 2e9 and links["flops_per_second_thread"] == 4e9
    two = links["by_group_size"]["2"]
    assert two["exchange_seconds"] == pytest.approx(0.002)
    assert two["bytes_per_second"] == pytest.approx(0.5e9)
    assert two["link"].byte_flops == pytest.approx(4.0) and two["link"].exchange_flops == pytest.approx(4e6)


def micro(ranks: int, lengths: list[int], row_tokens: int, seconds: float) -> dict:
    return {"seconds": seconds, "thread_seconds": seconds / 2, "ranks": ranks, "row_tokens": row_tokens,
            "real_tokens": sum(lengths), "pairs": len(lengths) // 2, "segments": [[n, 0] for n in lengths],
            "scored_tokens": sum(lengths) // 2}  # fmt: skip


def process(micro_batches: list[dict], wall: float, thread: float, gathered: int) -> dict:
    step = {"step": 1, "micro_batches": micro_batches, "wall_seconds": wall, "thread_seconds": thread,
            "gathered": {"keys_values": gathered, "other": 0}}  # fmt: skip
    warmup = dict(step, wall_seconds=100.0)
    return {"steps": [warmup, step], "peak_rss_bytes": 2**30, "peak_rss_bytes_built": 2**29}


def test_a_run_is_summarized_over_its_measured_steps():
    """Two processes: a row of 40 tokens on both (counted once), then each alone with a row of its own."""
    shared = micro(2, [12, 20], 40, seconds=1.0)
    processes = [
        process([shared, micro(1, [10, 6], 16, seconds=0.5)], wall=2.0, thread=1.0, gathered=5000),
        process([shared, micro(1, [30, 2], 32, seconds=0.25)], wall=3.0, thread=1.5, gathered=5000),
    ]
    run = {"shape": SHAPE.__dict__, "processes": processes}
    link = calibrated_links(
        {
            "processes": [
                {
                    "matmul_flops": 1e9,
                    "matmul_wall_seconds": 1.0,
                    "matmul_thread_seconds": 0.5,
                    "gathers": {
                        "2": [{"received_bytes": 0, "seconds": 1e-3}, {"received_bytes": 1e6, "seconds": 2e-3}]
                    },
                }
            ]
        }  # fmt: skip
    )
    summary = summarize(run, warmup=1, links=link)
    assert summary["steps"] == 1 and summary["step_seconds"] == 3.0  # the warm-up's 100 s left out
    assert summary["training_step_seconds"] == 1.0 + 0.5
    assert summary["real_tokens_per_step"] == 32 + 16 + 32
    assert summary["tokens_per_second"] == pytest.approx(80 / 3.0)
    assert (summary["rank_tokens_max"], summary["rank_tokens_mean"]) == (20 + 32, (36 + 52) / 2)
    assert summary["rank_tokens_micro_step_max"] == 32
    assert summary["ranks_per_row"] == pytest.approx(4 / 3)  # rows of 2, 1 and 1 ranks
    assert summary["thread_seconds_by_process"] == [1.0, 1.5]
    # The runs train with activation checkpointing (TRL's default): 4 exchanges a layer, the forward again
    assert summary["predicted_gathered_bytes_mean"] == gathered_bytes(SHAPE, 40, 2, 4, exchanges=4)
    two = link["by_group_size"]["2"]["link"]
    cost = functools.partial(split_row_cost, SHAPE, recompute=True)
    flops = cost([Segment(12), Segment(20)], 16, 40, 2, two) + max(
        cost([Segment(10), Segment(6)], 8, 16, 1, two), cost([Segment(30), Segment(2)], 16, 32, 1, two)
    )
    assert summary["predicted_step_seconds"] == pytest.approx(flops / 1e9)
    assert summary["predicted_step_error"] == pytest.approx(flops / 1e9 / 3.0 - 1)


def test_static_over_dynamic_is_time_for_the_same_tokens():
    static = {"seconds_per_real_token": 2.0, "predicted_seconds_per_real_token": 1.5, "tokens_per_thread_second": 1.0,
              "step_seconds": 4.0, "predicted_step_seconds": 3.0}  # fmt: skip
    dynamic = {"seconds_per_real_token": 1.0, "predicted_seconds_per_real_token": 1.0, "tokens_per_thread_second": 1.5,
               "step_seconds": 2.0, "predicted_step_seconds": 2.0}  # fmt: skip
    ratios = compare(static, dynamic)
    assert ratios["measured_time_ratio"] == 2.0 and ratios["predicted_time_ratio"] == 1.5
    assert ratios["ratio_error"] == pytest.approx(-0.25)
    assert ratios["measured_thread_time_ratio"] == 1.5 and ratios["measured_step_ratio"] == 2.0
