"""`trl-padfree bench`: the batches it builds, and a tiny run's JSON rows (no timing is asserted)."""

import json

import pytest

from trl_padfree.cli import main
from trl_padfree.cli.bench import DISTRIBUTIONS, PREFIX_SHARING, ROW_KEYS
from trl_padfree.cli.bench.harness import make_batches


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_batches_follow_the_distribution_and_respect_max_length(distribution):
    batches = make_batches(distribution, num_batches=3, pairs_per_batch=4, max_length=300, vocab_size=2048, seed=1)
    assert len(batches) == 3 and all(len(batch) == 4 for batch in batches)
    for pair in (pair for batch in batches for pair in batch):
        assert pair["prompt_ids"] and pair["chosen_ids"] and pair["rejected_ids"]
        for completion in ("chosen_ids", "rejected_ids"):
            assert len(pair["prompt_ids"]) + len(pair[completion]) < 300  # room for TRL's EOS
        assert min(pair["prompt_ids"] + pair["chosen_ids"] + pair["rejected_ids"]) >= 4  # no special token
    assert batches == make_batches(distribution, 3, 4, 300, 2048, seed=1)


def test_long_prompt_distribution_has_longer_prompts_than_chat():
    def mean_prompt(distribution):
        pairs = [pair for batch in make_batches(distribution, 8, 8, 4096, 2048, seed=0) for pair in batch]
        return sum(len(pair["prompt_ids"]) for pair in pairs) / len(pairs)

    assert mean_prompt("capybara") > 3 * mean_prompt("ultrafeedback")


def test_unknown_distribution_is_refused():
    with pytest.raises(ValueError, match="Unknown distribution 'hh'"):
        make_batches("hh", 1, 1, 100, 2048, seed=0)


def test_quick_run_writes_rows_of_the_documented_schema(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    output, plot = tmp_path / "rows.json", tmp_path / "speedup.png"
    args = ["bench", "--quick", "--batches", "1", "--pairs-per-batch", "3", "--max-length", "128"]
    args += ["--distributions", "ultrafeedback", "shipped", "--output", str(output), "--plot", str(plot)]
    assert main(args) == 0
    rows = json.loads(output.read_text())
    assert [(row["distribution"], row["backend"]) for row in rows] == [
        (distribution, backend)
        for distribution in ("ultrafeedback", "shipped")
        for backend in ("padfree_varlen", "sdpa", PREFIX_SHARING)
    ]
    for row in rows:
        assert set(ROW_KEYS) <= row.keys()
        assert row["device"].startswith("cpu")
        assert row["real_tokens"] == row["padded_mode_real_tokens"] > 0  # both modes processed the same tokens
        assert row["ideal_speedup"] == pytest.approx(row["padded_tokens"] / row["row_tokens"])
        if row["backend"] == PREFIX_SHARING:
            assert row["row_tokens"] < row["real_tokens"]
            assert row["ideal_speedup_over_unshared"] == pytest.approx(row["real_tokens"] / row["row_tokens"])
            assert row["speedup_over_unshared"] > 0
        else:
            assert row["row_tokens"] == row["real_tokens"] and row["speedup_over_unshared"] is None
        assert row["speedup"] == pytest.approx(row["padded_step_s"] / row["padfree_step_s"])
        assert row["padded_step_s"] > 0 and row["padfree_step_s"] > 0 and row["real_tokens_per_s"] > 0
        assert row["padded_peak_mem_mb"] > 0 and row["padfree_peak_mem_mb"] > 0
    assert plot.stat().st_size > 0
    assert "| ultrafeedback | padfree_varlen |" in capsys.readouterr().out


def test_batching_schemes_hold_the_same_pairs_and_budget_rows_fit_the_fixed_peak():
    from trl_padfree.cli.bench.budget import batching_schemes, row_length

    pairs = make_batches("capybara", 1, 40, 1024, 2048, seed=2)[0]
    fixed, budgeted, budget = batching_schemes(pairs, pairs_per_batch=4, seed=0)
    assert budget == max(row_length(batch) for batch in fixed)
    assert all(row_length(batch) <= budget for batch in budgeted)
    assert len(budgeted) <= len(fixed)
    key = lambda batches: sorted(id(pair) for batch in batches for pair in batch)  # noqa: E731
    assert key(fixed) == key(budgeted) == sorted(id(pair) for pair in pairs)


def test_batching_run_writes_its_rows(tmp_path, capsys):
    output = tmp_path / "batching.json"
    args = ["bench", "--batching", "--quick", "--batches", "2", "--pairs-per-batch", "3", "--max-length", "128"]
    assert main([*args, "--distributions", "ultrafeedback", "--output", str(output)]) == 0
    (row,) = json.loads(output.read_text())
    assert row["pairs"] == 6 and row["fixed_steps_per_epoch"] == 2 and row["budget_steps_per_epoch"] <= 2
    assert row["fixed_tokens_per_s"] > 0 and row["budget_tokens_per_s"] > 0 and 0 < row["budget_fill"] <= 1
    assert "| ultrafeedback | 6 | 3 |" in capsys.readouterr().out


def test_vision_run_counts_the_images_each_mode_encodes(tmp_path, capsys):
    output = tmp_path / "vision.json"
    args = ["bench", "--vision", "--device", "cpu", "--batches", "1", "--pairs-per-batch", "3"]
    assert main([*args, "--output", str(output)]) == 0
    rows = {row["mode"]: row for row in json.loads(output.read_text())}
    assert list(rows) == ["padded", "padfree_varlen", "padfree_varlen+prefix_sharing"]
    # TRL hands each image over with the chosen and again with the rejected sequence; a shared prompt holds it once
    assert [row["images_encoded_per_step"] for row in rows.values()] == [6, 6, 3]
    assert [row["images_encoded_per_pair"] for row in rows.values()] == [2, 2, 1]
    assert rows["padded"]["ideal_speedup"] == 1.0 and rows["padfree_varlen+prefix_sharing"]["ideal_speedup"] > 1
    tokens = [row["language_model_tokens_per_step"] for row in rows.values()]
    assert tokens[0] > tokens[1] > tokens[2]
    assert rows["padded"]["speedup"] == 1.0
    assert "| padfree_varlen+prefix_sharing |" in capsys.readouterr().out


def test_vision_run_is_refused_on_a_text_model():
    with pytest.raises(SystemExit):  # the CLI's one-line error
        main(["bench", "--vision", "--model", "small"])
