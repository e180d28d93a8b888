"""Balanced ranks: `packing.balance` (pair costs, the two-level LPT partition, the imbalance measure) against
hand-computed numbers and brute-force optima, and the `trl-padfree balance` simulation on tiny settings."""

import itertools
import json
import random

import pytest

from trl_padfree.cli import balance as balance_cli
from trl_padfree.cli import main
from trl_padfree.cli.bench.harness import make_batches
from trl_padfree.costs.flops import DecoderShape, Segment, packed_row_work, training_step_flops
from trl_padfree.packing.balance import (
    best_split,
    bin_costs,
    imbalance,
    pair_cost,
    partition,
    row_cost_lower_bound,
    sorted_partition,
)

# linear 1000 per token, LM head 8 x 50, 2 attention layers of 2 heads x 4
SHAPE = DecoderShape(
    linear_params=1000, hidden_size=8, vocab_size=50, attention_layers=2, num_attention_heads=2, head_dim=4
)

# ---------------------------------------------------------------------------------------------------------------------
# pair_cost


def test_pair_cost_is_the_flop_model_of_both_sequences():
    # chosen 5 + rejected 3 tokens: linear 1000 x 8; head 400 x 4 scored; attention 2 x 2 x 4 x (15 + 6) pairs x 2
    # layers = 672; 2 FLOPs per multiply-add, 4 forwards (policy forward + backward, reference forward)
    assert pair_cost(SHAPE, 5, 3, scored_tokens=4) == 4 * 2 * (8000 + 1600 + 672)
    assert pair_cost(SHAPE, 5, 3, scored_tokens=4, reference_forward=False) == 3 * 2 * (8000 + 1600 + 672)


def test_pair_cost_with_a_shared_prefix_drops_it_from_the_rejected_branch():
    # The rejected branch keeps 1 token, reading 2 prefix tokens: 6 row tokens, 15 + (1 x 2 + 1) = 18 pairs
    assert pair_cost(SHAPE, 5, 3, scored_tokens=4, shared_prefix=2) == 4 * 2 * (6000 + 1600 + 2 * 2 * 4 * 18 * 2)


def test_pair_costs_add_up_to_the_packed_row():
    pairs = [(5, 3, 4, 0), (1, 1, 1, 0), (40, 31, 30, 9)]  # (chosen, rejected, scored, shared prefix)
    segments = [
        segment
        for chosen, rejected, _, prefix in pairs
        for segment in (Segment(chosen), Segment(rejected - prefix, prefix=prefix))
    ]
    row = training_step_flops(SHAPE, packed_row_work(segments, scored_tokens=sum(pair[2] for pair in pairs)))
    assert sum(pair_cost(SHAPE, *pair) for pair in pairs) == row


@pytest.mark.parametrize("chosen, rejected, prefix", [(0, 3, 0), (5, 3, 3), (5, 3, -1), (2, 9, 2)])
def test_pair_cost_refuses_impossible_pairs(chosen, rejected, prefix):
    with pytest.raises(ValueError):
        pair_cost(SHAPE, chosen, rejected, scored_tokens=1, shared_prefix=prefix)


# ---------------------------------------------------------------------------------------------------------------------
# partition


def random_costs(rng: random.Random, count: int) -> list[float]:
    # Lognormal like pair lengths, with some exact ties and a zero
    costs = [round(rng.lognormvariate(0, 0.9), 1) for _ in range(count)]
    costs[rng.randrange(count)] = 0.0
    return costs


@pytest.mark.parametrize("processes, micro_steps, count", [(1, 1, 1), (3, 1, 3), (4, 1, 17), (3, 3, 10), (8, 4, 97)])
def test_partition_places_every_pair_once_and_gives_every_process_a_row(processes, micro_steps, count):
    costs = random_costs(random.Random(count), count)
    bins = partition(costs, processes, micro_steps)
    assert len(bins) == micro_steps and all(len(step) == processes for step in bins)
    placed = [index for step in bins for row in step for index in row]
    assert sorted(placed) == list(range(count))
    assert all(row and row == sorted(row) for step in bins for row in step)
    least = count // micro_steps
    assert sorted(sum(len(row) for row in step) for step in bins) == sorted(
        [least + 1] * (count % micro_steps) + [least] * (micro_steps - count % micro_steps)
    )


def test_partition_breaks_ties_by_index_and_never_leaves_a_process_empty():
    assert partition([1.0] * 6, processes=3) == [[[0, 3], [1, 4], [2, 5]]]
    assert partition([0.0, 0.0, 0.0, 5.0], processes=4) == [[[3], [0], [1], [2]]]  # free pairs still spread


def test_partition_is_deterministic():
    costs = random_costs(random.Random(0), 200)
    first = partition(costs, 8, 3)
    assert partition(tuple(costs), 8, 3) == first
    assert partition(list(costs), 8, 3) == first


def test_micro_steps_cost_about_the_same():
    costs = random_costs(random.Random(1), 400)
    step_totals = [sum(rows) for rows in bin_costs(costs, partition(costs, 4, 5))]
    assert max(step_totals) - min(step_totals) <= max(costs)


def optimal_makespan(costs: list[float], processes: int) -> float:
    """Brute force: the least possible most expensive row."""
    best = float("inf")
    for assignment in itertools.product(range(processes), repeat=len(costs)):
        rows = [0.0] * processes
        for cost, process in zip(costs, assignment, strict=True):
            rows[process] += cost
        best = min(best, max(rows))
    return best


@pytest.mark.parametrize("processes", [2, 3])
def test_lpt_is_within_its_bound_of_the_optimum(processes):
    rng = random.Random(processes)
    bound = 4 / 3 - 1 / (3 * processes)
    for _ in range(40):
        costs = [float(rng.randint(1, 30)) for _ in range(rng.randint(processes, 8))]
        optimum = optimal_makespan(costs, processes)
        makespan = max(bin_costs(costs, partition(costs, processes))[0])
        assert row_cost_lower_bound(costs, processes) <= optimum <= makespan <= bound * optimum + 1e-9


def test_lpt_bound_against_the_optimum_not_the_mean_or_largest_pair():
    # 4 equal pairs over 3 processes: the optimum (and LPT) is 4, yet max(mean, largest) is only 8/3, so a check of
    # LPT against 4/3 x that would fail on a perfect split; the pigeonhole bound sees the shared row
    costs = [2.0, 2.0, 2.0, 2.0]
    assert max(bin_costs(costs, partition(costs, 3))[0]) == optimal_makespan(costs, 3) == 4.0
    assert 4.0 > 4 / 3 * max(sum(costs) / 3, max(costs))
    assert row_cost_lower_bound(costs, 3) == 4.0


@pytest.mark.parametrize("processes, count", [(8, 32), (64, 256), (512, 4096)])
def test_lpt_rows_stay_within_graham_bound_on_large_batches(processes, count):
    # The row LPT fills last costs at most the mean plus (1 - 1/m) x its last pair, itself at most c[m] once every
    # process has a pair: max <= max(c[0], mean + (1 - 1/m) c[m]); never below what any split reaches
    costs = random_costs(random.Random(count), count)
    rows = bin_costs(costs, partition(costs, processes))[0]
    ordered, mean = sorted(costs, reverse=True), sum(costs) / processes
    graham = max(ordered[0], mean + (1 - 1 / processes) * ordered[processes])
    assert row_cost_lower_bound(costs, processes) - 1e-9 <= max(rows) <= graham
    per_process = count // processes
    dealt = [sum(costs[start : start + per_process]) for start in range(0, count, per_process)]
    assert imbalance([rows]) < imbalance([dealt])


@pytest.mark.parametrize(
    "costs, processes, micro_steps, message",
    [
        ([1.0] * 7, 4, 2, "at least 8 pairs"),
        ([1.0] * 3, 4, 1, "at least 4 pairs"),
        ([1.0, -1.0], 1, 1, "non-negative"),
        ([1.0, float("nan")], 1, 1, "non-negative"),
        ([1.0], 0, 1, "at least 1"),
    ],
)
def test_partition_refuses_what_leaves_a_process_without_a_row(costs, processes, micro_steps, message):
    with pytest.raises(ValueError, match=message):
        partition(costs, processes, micro_steps)


def test_imbalance_is_the_ratio_of_step_times():
    assert imbalance([[3.0, 1.0]]) == 1.5
    # micro-steps weigh by their cost: (3 + 10) / (2 + 10)
    assert imbalance([[3.0, 1.0], [10.0, 10.0]]) == pytest.approx(13 / 12)
    with pytest.raises(ValueError):
        imbalance([[0.0, 0.0]])


# ---------------------------------------------------------------------------------------------------------------------
# trl-padfree balance


@pytest.fixture
def small_pool(monkeypatch):
    monkeypatch.setattr(balance_cli, "POOL_PAIRS", 2048)


def test_the_simulation_draws_the_bench_pairs():
    batches = make_batches("capybara", 2, 3, max_length=64, vocab_size=100, seed=5)
    drawn = [
        tuple(len(pair[key]) for key in ("prompt_ids", "chosen_ids", "rejected_ids")) for b in batches for pair in b
    ]
    assert balance_cli.sampled_pairs("capybara", 6, max_length=64, seed=5) == drawn


def test_balance_command_reports_unbalanced_and_balanced_rows(tmp_path, capsys, small_pool):
    output = tmp_path / "rows.json"
    args = ["balance", "--distribution", "ultrafeedback", "--processes", "2", "8", "--pairs-per-process", "3"]
    assert main([*args, "--steps", "20", "--model-config", "qwen2.5-0.5b", "--output", str(output)]) == 0
    rows = json.loads(output.read_text())
    assert [(row["processes"], row["pairs_per_process"]) for row in rows] == [(2, 3), (8, 3)]
    for row in rows:
        assert row["distribution"] == "ultrafeedback" and row["micro_steps"] == 1 and row["steps"] == 20
        assert 1.0 <= row["lower_bound"] <= row["balanced"] < row["unbalanced"]
        assert row["step_time_gain"] == pytest.approx(row["unbalanced"] / row["balanced"])
    header = capsys.readouterr().out.splitlines()[0]
    for column in ("distribution", "pairs per process", "processes", "unbalanced", "balanced", "step-time gain"):
        assert column in header


def test_balance_command_on_a_pre_tokenized_jsonl(tmp_path, small_pool):
    rng = random.Random(0)
    pairs = [
        {"prompt_ids": [7] * rng.randint(1, 40), "chosen_ids": [8] * rng.randint(1, 90), "rejected_ids": [9]}
        for _ in range(30)
    ]
    pairs.append({"prompt_ids": [7] * 64, "chosen_ids": [8], "rejected_ids": [9]})  # its prompt fills max_length
    dataset = tmp_path / "pairs.jsonl"
    dataset.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    kept = balance_cli.dataset_pairs(str(dataset), None, max_length=64, split="train")
    assert len(kept) == 30 and all(prompt + completion <= 64 for prompt, *rest in kept for completion in rest)
    output = tmp_path / "rows.json"
    args = ["balance", "--dataset", str(dataset), "--max-length", "64", "--processes", "4", "--pairs-per-process"]
    assert main([*args, "2", "--micro-steps", "2", "--steps", "10", "--output", str(output)]) == 0
    (row,) = json.loads(output.read_text())
    assert row["distribution"] == "pairs.jsonl" and row["micro_steps"] == 2
    assert row["balanced"] <= row["unbalanced"]


def test_dataset_strings_are_tokenized_with_an_eos_per_completion(tmp_path):
    dataset = tmp_path / "pairs.json"
    dataset.write_text(json.dumps([{"prompt": "Hello there", "chosen": " yes", "rejected": " no"}]))
    (pair,) = balance_cli.dataset_pairs(str(dataset), None, max_length=1024, split="train")
    tokenizer = balance_cli.load_demo_tokenizer()
    count = len(tokenizer(" yes", add_special_tokens=False)["input_ids"])
    assert pair[1] == count + 1


def test_model_config_from_a_config_json(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = balance_cli.load_decoder_shape(str(tmp_path / "config.json"))
    # Per layer q, k, v, o (64 x 64 each), gate, up, down (64 x 128 each) and 2 norms of 64; the final norm
    assert shape.linear_params == 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert (shape.vocab_size, shape.attention_layers, shape.head_dim) == (100, 2, 16)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--processes", "0"], "--processes"),
        (["--model-config", "no-such-model"], "no-such-model"),
        (["--dataset", "pairs.jsonl", "--distribution", "capybara"], "alternatives"),
        (["--tokenizer", "my-tokenizer"], "--dataset"),
    ],
)
def test_bad_balance_options_are_one_line_errors(args, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["balance", *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "error:" in error and expected in error


# ---------------------------------------------------------------------------------------------------------------------
# best_split: what a balanced step runs


def test_with_one_pair_per_row_neighbouring_costs_share_a_micro_step():
    rng = random.Random(4)
    costs = [rng.paretovariate(1.5) for _ in range(64)]  # 16 micro-steps x 4 processes, one pair each
    dealt = [[[4 * step + process] for process in range(4)] for step in range(16)]
    spread = imbalance(bin_costs(costs, partition(costs, 4, 16)))
    best = imbalance(bin_costs(costs, best_split(costs, 4, 16, dealt)))
    assert best == imbalance(bin_costs(costs, sorted_partition(costs, 4, 16)))  # sorted runs won
    assert best < 0.8 * spread and best < 0.8 * imbalance(bin_costs(costs, dealt))


@pytest.mark.parametrize("pairs_per_process", [1, 2, 4])
def test_best_split_is_never_slower_nor_a_costlier_row_than_dealt(pairs_per_process):
    rng = random.Random(pairs_per_process)
    for _ in range(50):
        processes, micro_steps = rng.choice([2, 4, 8]), rng.choice([1, 2, 4])
        count = processes * micro_steps * pairs_per_process
        costs = [rng.lognormvariate(0, 1) for _ in range(count)]
        dealt = [[list(range((step * processes + process) * pairs_per_process, (step * processes + process + 1)
                             * pairs_per_process)) for process in range(processes)] for step in range(micro_steps)]  # fmt: skip
        split = best_split(costs, processes, micro_steps, dealt)
        assert sorted(i for step in split for row in step for i in row) == list(range(count))
        assert imbalance(bin_costs(costs, split)) <= imbalance(bin_costs(costs, dealt)) + 1e-12
        largest = max(max(step) for step in bin_costs(costs, split))
        assert largest <= max(max(step) for step in bin_costs(costs, dealt)) + 1e-12
