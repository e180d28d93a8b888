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


def long_tailed_units(count: int = 400):
    rng = random.Random(3)
    pairs = [truncated_pair_lengths(*sample_lengths(REASONING, rng, 512), 512) for _ in range(count)]
    pairs += [(50, 950, 900), (1, 2000, 2030)]  # one pair that needs 2 ranks of 1,024 tokens, one that needs 4
    rng.shuffle(pairs)
    return [simulation.pair_unit(*pair) for pair in pairs]


@pytest.mark.parametrize("ranks", [4, 8])
def test_dynamic_micro_steps_tile_every_rank_within_the_budget_and_hold_the_same_pairs_as_static(ranks):
    units = long_tailed_units()
    budget = simulation.GroupBudget(SHAPE, ranks, rank_budget=1024)
    static, dynamic = simulation.static_layout(units, budget), simulation.dynamic_layout(units, budget)
    for layout in (static, dynamic):
        trained = sorted(number for rows in layout.members for numbers, _, _ in rows for number in numbers)
        assert trained == list(range(len(units)))
        assert layout.tokens.sum() == sum(unit.tokens for unit in units) and layout.pairs.sum() == len(units)
        assert np.all(layout.rank_tokens <= 1024)
    for rows in dynamic.members:
        assert sorted(rank for _, first, share in rows for rank in range(first, first + share)) == list(range(ranks))
        for numbers, _, share in rows:
            assert sum(units[number].tokens for number in numbers) <= budget.capacity(share) == share * 1024
    shares = {share for rows in dynamic.members for _, _, share in rows}
    assert 1 in shares and max(shares) >= 4  # short pairs alone on a rank, the longest over the ranks it needs
    # A row on one rank gathers nothing, so dynamic gathers less than every row over all ranks
    assert dynamic.rank_bytes.sum() < static.rank_bytes.sum()


def test_a_row_costs_its_slowest_rank_over_its_own_ranks_link():
    budget = simulation.GroupBudget(SHAPE, ranks=16, rank_budget=4096)
    units = [simulation.pair_unit(*pair) for pair in [(7, 30, 2), (100, 5, 900)]]
    segments = [segment for unit in units for segment in unit.segments]
    # 46 + 1,105 = 1,151 tokens padded to a multiple of the group's 16 ranks: 1,152; 32 + 905 scored. On one rank no
    # link is used
    alone = split_row_cost(SHAPE, segments, 937, 1152, 1, context_parallel.NVLINK, recompute=True)
    assert budget.row_cost(units, 1, context_parallel.INFINIBAND) == alone
    expected = split_row_cost(SHAPE, segments, 937, 1152, 2, context_parallel.INFINIBAND, recompute=True)
    assert budget.planned_cost(units, 2) == expected  # the trainer's planner: the group's link
    layout = simulation.priced_layout("dynamic", units, [[((0, 1), 0, 2), ((), 2, 14)]], budget, per_round=1)
    # The simulated time: a row on 2 of 16 ranks is inside a node. Activation checkpointing on (TRL's default)
    nvlink = split_row_cost(SHAPE, segments, 937, 1152, 2, context_parallel.NVLINK, recompute=True)
    assert layout.seconds[0] == pytest.approx(nvlink / simulation.ASSUMED_FLOPS_PER_SECOND)
    assert layout.rank_tokens[0].tolist() == [576, 576] + [0] * 14
    assert layout.rank_bytes[0, 2:].tolist() == [0] * 14 and layout.rank_bytes[0, 0] > 0


def hand_made_layout(seconds, ranks, per_round):
    count = len(seconds)
    return simulation.Layout(
        "hand-made",
        ranks,
        4,
        per_round,
        seconds=np.array(seconds, dtype=float),
        tokens=np.full(count, 4 * ranks),
        pairs=np.ones(count, dtype=int),
        rank_tokens=np.full((count, ranks), 4),
        rank_bytes=np.zeros((count, ranks)),
        members=[[((number,), 0, ranks)] for number in range(count)],
        rows=[[] for _ in range(count)],
    )


def test_every_micro_step_lasts_its_slowest_group_and_the_last_round_runs_with_the_groups_left():
    # Dynamic: 2 groups of 2 ranks at 4 processes, one micro-step each a round; 3 micro-steps: 2 rounds, one idle group
    seconds = [2.0, 3.0, 1.0]
    first, second, third = np.random.default_rng([0, 0]).permutation(3)  # the epoch's order
    figures = simulation.trained(hand_made_layout(seconds, 2, 1), 4, epochs=1, seed=0)
    assert figures.epoch_seconds == max(seconds[first], seconds[second]) + seconds[third]
    assert figures.lockstep_micro_steps == 2
    # Static: a round of 4 bins gives each group its 2 ranks' bins, 2 micro-steps. 3 epochs of 3 bins of 2 s: 2 full
    # rounds (4 micro-steps), then 1 bin: 5 micro-steps of 2 s
    figures = simulation.trained(hand_made_layout([2.0, 2.0, 2.0], 2, 2), 4, epochs=3, seed=0)
    assert figures.epoch_seconds == pytest.approx(10.0 / 3) and figures.lockstep_micro_steps == pytest.approx(5 / 3)
    assert figures.tokens_per_second_per_gpu == pytest.approx(3 * 3 * 8 / 10.0 / 4)
    assert figures.fill == 1.0 and figures.rank_tokens_max_over_mean == 1.0 and figures.gathered_mb_per_rank == 0


def test_the_command_writes_finite_ratios_and_the_best_static_group(tmp_path, capsys):
    output = tmp_path / "rows.json"
    args = ["balance", "--context-parallel", "2", "4", "--distribution", "reasoning", "--processes", "2", "8"]
    args += ["--model-config", "qwen2.5-0.5b", "--rank-budget", "2048"]
    assert main([*args, "--pool-bins", "12", "--steps", "5", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["assumptions"]["links"]["nvlink"]["byte_flops"] == context_parallel.NVLINK.byte_flops
    assert "not modelled" in report["assumptions"]["cost_model"] and "Links" in report["assumptions"]["not_modelled"]
    # Groups of 4 cannot run on 2 processes; --max-length: a pair that fills the group
    assert [(row["ranks"], row["processes"], row["max_length"]) for row in report["rows"]] == [
        (2, 2, 2048),
        (2, 8, 2048),
        (4, 8, 4096),
    ]
    for row in report["rows"]:
        assert row["longest_pair"] <= row["ranks"] * 2048 and row["epochs"] >= 1
        assert np.isfinite(row["time_ratio"]) and row["time_ratio"] > 0
        assert np.isfinite(row["over_best_static"]) and str(row["best_static_ranks"]) in row["static_by_ranks"]
        assert row["static_by_ranks"][str(row["ranks"])] == row["static"]
        assert sum(row["dynamic_pairs_by_ranks"].values()) == pytest.approx(1.0)
        for layout in (row["static"], row["dynamic"]):
            assert 0 < layout["fill"] <= 1 and np.isfinite(layout["tokens_per_second_per_gpu"])
        blocks = [(first, share) for _, _, first, share, _ in row["sample_micro_step"]]
        assert sorted(rank for first, share in blocks for rank in range(first, first + share)) == list(
            range(row["ranks"])
        )
    assert "static / dynamic" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--context-parallel", "4", "3"], "powers of two"),
        (["--context-parallel", "4", "8", "--processes", "6"], "multiples of a --context-parallel [4, 8]"),
        (["--context-parallel", "4", "--micro-steps", "2"], "--micro-steps: not with --context-parallel"),
        (["--context-parallel", "2", "--max-length", "8192", "--rank-budget", "1024"], "does not fit 2 ranks"),
    ],
)
def test_the_command_refuses_what_it_cannot_simulate(extra, message, capsys):
    args = ["balance", "--distribution", "reasoning", "--model-config", "qwen2.5-0.5b", "--pool-bins", "4"]
    with pytest.raises(SystemExit) as exit_:
        main([*args, *extra])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
