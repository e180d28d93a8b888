"""`trl-padfree balance --context-parallel`: static against dynamic context parallelism, simulated with the cost model
(trl_padfree/cli/context_parallel_balance.py), and the reasoning-trace length model it draws from."""

import json
import random

import numpy as np
import pytest

from trl_padfree.cli import balance as balance_cli
from trl_padfree.cli import context_parallel_balance as simulation
from trl_padfree.cli import main
from trl_padfree.cli.bench.harness import sample_lengths, truncated_pair_lengths
from trl_padfree.costs import context_parallel
from trl_padfree.costs.context_parallel import split_row_cost
from trl_padfree.data.length_models import REASONING

SHAPE = balance_cli.load_decoder_shape("qwen2.5-0.5b")


def test_the_reasoning_length_model_is_mostly_short_with_a_tail_past_32k():
    rng = random.Random(0)
    drawn = [truncated_pair_lengths(*sample_lengths(REASONING, rng, 65536), 65536) for _ in range(20_000)]
    tokens = np.array([2 * prompt + chosen + rejected for prompt, chosen, rejected in drawn])
    assert 2_500 < np.median(tokens) < 4_000
    assert 0.5 < np.mean((tokens >= 1_000) & (tokens <= 4_096)) < 0.65
    assert 15_000 < np.quantile(tokens, 0.99) < 35_000
    assert 0.002 < np.mean(tokens > 32_768) < 0.01
    assert tokens.max() <= 2 * 65536


def test_the_assumed_rate_is_the_one_the_links_are_built_on():
    assert context_parallel.NVLINK == context_parallel.Link.of_rates(simulation.ASSUMED_FLOPS_PER_SECOND, 360e9, 25e-6)


def long_tailed_bins(rank_budget: int, ranks: int, count: int):
    rng = random.Random(3)
    pairs = [truncated_pair_lengths(*sample_lengths(REASONING, rng, 512), 512) for _ in range(400)]
    pairs += [(50, 950, 900)]  # one pair that needs 2 ranks
    rng.shuffle(pairs)
    return simulation.packed_bins(pairs, ranks * rank_budget, count)[:count]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_dynamic_never_costs_more_than_static_and_its_rows_tile_every_rank(ranks):
    split = simulation.SplitRows(SHAPE, rank_budget=1024)
    bins = long_tailed_bins(1024, ranks, 24)
    static = simulation.price_bins(bins, ranks, split, dynamic=False)
    dynamic = simulation.price_bins(bins, ranks, split, dynamic=True)
    # The planner's last try is the static split (the bin's pairs longest first, as packed), so it never picks worse
    assert np.all(dynamic.cost <= static.cost)
    assert np.any(dynamic.cost < static.cost)
    assert np.array_equal(dynamic.tokens, static.tokens)
    for units, shares in zip(bins, dynamic.shares, strict=True):
        blocks = [range(first, first + size) for _, _, first, size in shares]
        assert sorted(rank for block in blocks for rank in block) == list(range(ranks))
        assert sum(pairs for pairs, *_ in shares) == len(units)
        assert all(simulation.padded(tokens, size) <= size * 1024 for _, tokens, _, size in shares)
    assert np.all(dynamic.rank_tokens <= 1024) and np.all(static.rank_tokens <= 1024)
    assert np.all(dynamic.rank_bytes <= static.rank_bytes)


def test_a_row_on_one_rank_costs_the_sum_of_its_pairs_and_gathers_nothing():
    split = simulation.SplitRows(SHAPE, rank_budget=4096)
    units = [simulation.pair_unit(*pair) for pair in [(7, 30, 2), (100, 5, 900)]]
    alone = [split.row_cost([unit], 1) for unit in units]
    assert split.row_cost(units, 1) == sum(alone)
    segments = [segment for unit in units for segment in unit.segments]
    # 46 + 1,105 = 1,151 tokens padded to 1,152, 32 + 905 scored
    assert split.row_cost(units, 2) == split_row_cost(SHAPE, segments, 937, 1152, 2, context_parallel.NVLINK)
    priced = simulation.price_bins([units], 1, split, dynamic=True)
    assert priced.rank_bytes.tolist() == [[0]] and priced.rank_tokens.tolist() == [[1151]]


def test_steps_take_the_slowest_group_at_each_micro_step():
    pool = simulation.PricedBins(
        cost=np.array([1.0, 3.0]) * simulation.ASSUMED_FLOPS_PER_SECOND,
        tokens=np.array([10, 30]),
        rank_tokens=np.array([[5, 5], [15, 15]]),
        rank_bytes=np.array([[0, 0], [2e9, 2e9]]),
        shares=[[], []],
    )
    (figures,) = simulation.simulated_steps([pool], processes=2, steps=3, rng=np.random.default_rng(0))
    assert figures.step_seconds == pytest.approx(4.0)  # one group, its two bins one after the other
    assert figures.tokens_per_second_per_gpu == pytest.approx(40 / 4 / 2)
    assert figures.rank_tokens_max_over_mean == pytest.approx(1.0) and figures.gathered_gb_per_rank == 2.0


def test_the_command_writes_finite_ratios_and_the_best_static_group(tmp_path, capsys):
    output = tmp_path / "rows.json"
    args = ["balance", "--context-parallel", "4", "--distribution", "reasoning", "--processes", "4", "16"]
    args += ["--model-config", "qwen2.5-0.5b", "--max-length", "8192", "--rank-budget", "4096"]
    assert main([*args, "--pool-bins", "20", "--steps", "5", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["assumptions"]["links"]["nvlink"]["byte_flops"] == context_parallel.NVLINK.byte_flops
    assert "not modelled" in report["assumptions"]["cost_model"]
    assert [row["processes"] for row in report["rows"]] == [4, 16]
    for row in report["rows"]:
        assert row["longest_pair"] <= 4 * 4096
        assert np.isfinite(row["step_time_ratio"]) and row["step_time_ratio"] >= 1.0
        assert np.isfinite(row["over_best_static"]) and row["best_static_ranks"] in (1, 2, 4)
        assert str(row["best_static_ranks"]) in row["static_by_ranks"]
        assert len(row["sample_group"]) == 4
    assert "static / dynamic" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--context-parallel", "3"], "power of two"),
        (["--context-parallel", "4", "--processes", "6"], "multiples of --context-parallel 4"),
        (["--context-parallel", "4", "--micro-steps", "2"], "--micro-steps: not with --context-parallel"),
        (["--context-parallel", "2", "--max-length", "8192", "--rank-budget", "1024"], "does not fit 2 ranks"),
    ],
)
def test_the_command_refuses_what_it_cannot_simulate(extra, message, capsys):
    args = ["balance", "--distribution", "reasoning", "--model-config", "qwen2.5-0.5b", "--pool-bins", "4"]
    with pytest.raises(SystemExit) as exit_:
        main([*args, *extra])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
