"""`trl-padfree bench`: the batches it builds, the FLOP model it measures against, the structure of its timed steps,
a tiny run's JSON rows (no timing is asserted), and each precision's varlen kernel calls per attention call through
the strict stand-in of torch's kernel (tests/support/stand_in_kernels.py)."""

import argparse
import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from stand_in_kernels import varlen_stand_in

from trl_padfree.cli import main
from trl_padfree.cli.bench import harness
from trl_padfree.cli.bench.harness import (
    DISTRIBUTIONS,
    StepTimer,
    batch_work,
    decoder_shape,
    make_batches,
    make_bench_model,
)
from trl_padfree.cli.bench.rows import PREFIX_SHARING, PREFIX_SHARING_AUTO, ROW_KEYS, set_step_counts
from trl_padfree.costs import flops
from trl_padfree.costs.flops import (
    BatchWork,
    DecoderShape,
    Segment,
    causal_pairs,
    flop_ideal_speedup,
    forward_flops,
    packed_row_work,
    padded_batch_work,
    training_step_flops,
)
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.packing.collator import concatenated_inputs
from trl_padfree.packing.layout import HOST_ROW, HostRow


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


def test_quick_run_writes_rows_of_the_documented_schema(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    steps = []  # every step the harness runs, warm-up or measured
    timed_step = harness.timed_step
    monkeypatch.setattr(harness, "timed_step", lambda *args: steps.append(1) or timed_step(*args))
    output, plot = tmp_path / "rows.json", tmp_path / "speedup.png"
    # No warm-up (the default is 1 on CPU) and 2 measured steps: as many steps as the default's 1 + 1, counted apart
    args = ["bench", "--quick", "--warmup", "0", "--steps", "2", "--pairs-per-batch", "3", "--max-length", "128"]
    args += ["--distributions", "ultrafeedback", "shipped", "--output", str(output), "--plot", str(plot)]
    assert main(args) == 0
    rows = json.loads(output.read_text())["rows"]
    assert [(row["distribution"], row["backend"]) for row in rows] == [
        (distribution, backend)
        for distribution in ("ultrafeedback", "shipped")
        for backend in ("padfree_varlen", "sdpa", PREFIX_SHARING, PREFIX_SHARING_AUTO)
    ]
    assert len(steps) == 2 * 5 * (0 + 2)  # distributions x modes (padded + 4) x (warm-up + measured)
    for row in rows:
        assert set(ROW_KEYS) <= row.keys()
        assert row["device"].startswith("cpu")
        assert row["precision"] == "float32" and row["lora"] is False  # the CPU default: no autocast
        assert row["varlen_calls"] == 0 and row["varlen_calls_per_attention_call"] == 0.0  # no kernel on CPU
        assert row["real_tokens"] == row["padded_mode_real_tokens"] > 0  # both modes processed the same tokens
        assert row["ideal_speedup"] == pytest.approx(row["padded_tokens"] / row["row_tokens"])
        if row["backend"] == PREFIX_SHARING:
            assert row["row_tokens"] < row["real_tokens"]
        if row["backend"] in (PREFIX_SHARING, PREFIX_SHARING_AUTO):  # auto may lay a batch out unshared
            assert row["row_tokens"] <= row["real_tokens"]
            assert row["ideal_speedup_over_unshared"] == pytest.approx(row["real_tokens"] / row["row_tokens"])
            assert row["speedup_over_unshared"] > 0
        else:
            assert row["row_tokens"] == row["real_tokens"] and row["speedup_over_unshared"] is None
        assert row["speedup"] == pytest.approx(row["padded_step_s"] / row["padfree_step_s"])
        assert row["padded_step_s"] > 0 and row["padfree_step_s"] > 0 and row["real_tokens_per_s"] > 0
        assert row["padded_peak_mem_mb"] > 0 and row["padfree_peak_mem_mb"] > 0
        _assert_spread_host_time_and_flops(row, warmup=0, steps=2)
    assert plot.stat().st_size > 0
    out = capsys.readouterr().out
    assert "| ultrafeedback | padfree_varlen |" in out and "| FLOP ideal | of FLOP ideal |" in out
    assert "| shipped | padded | 0 + 2 |" in out  # the step table: padded TRL once per distribution


def test_rows_carry_their_precision_and_varlen_calls_per_attention_call(tmp_path, capsys):
    """Both precisions, each against padded TRL in the same precision, through the strict stand-in of torch's
    varlen kernel (the packed forward's CUDA branch, on CPU): with TRL's default (float32 weights under bf16
    autocast) the queries and keys reach the kernel cast to bf16, one kernel call per attention call, as with bf16
    weights; packed sdpa never calls it."""
    output = tmp_path / "rows.json"
    args = ["bench", "--model", "tiny", "--precision", "both", "--backends", "padfree_varlen", "sdpa"]
    args += ["--prefix-sharing", "auto", "--distributions", "ultrafeedback", "--warmup", "0", "--steps", "1"]
    args += ["--pairs-per-batch", "2", "--max-length", "32", "--output", str(output)]
    make_bench_model("tiny", "sdpa", torch.float32)  # the model's modules imported before the stand-in
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        assert main(args) == 0
    rows = json.loads(output.read_text())["rows"]
    calls = {(row["precision"], row["backend"]): row["varlen_calls_per_attention_call"] for row in rows}
    assert calls == {
        (precision, backend): 0.0 if backend == "sdpa" else 1.0
        for precision in ("trl_default", "bf16")
        for backend in ("padfree_varlen", "sdpa", PREFIX_SHARING_AUTO)
    }
    layers = make_bench_model("tiny", "sdpa", torch.float32).config.num_hidden_layers
    for row in rows:  # policy forward, its recompute in the backward (checkpointing on), reference forward
        assert row["activation_checkpointing"] and row["attention_calls"] == 3 * layers
    out = capsys.readouterr().out
    assert "| precision | distribution | backend |" in out and "| varlen calls / attention call |" in out
    assert "| trl_default | ultrafeedback | padfree_varlen |" in out and "| bf16 | ultrafeedback | padded |" in out


def test_float32_without_autocast_reports_no_kernel_call(tmp_path):
    """float32 weights with no autocast: the kernel takes half precision only, so the packed forward runs each
    sequence apart, and the row says so (0 calls per attention call)."""
    output = tmp_path / "rows.json"
    args = ["bench", "--model", "tiny", "--precision", "float32", "--backends", "padfree_varlen"]
    args += ["--no-prefix-sharing", "--distributions", "ultrafeedback", "--warmup", "0", "--steps", "1"]
    args += ["--pairs-per-batch", "2", "--max-length", "32", "--output", str(output)]
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        assert main(args) == 0
    (row,) = json.loads(output.read_text())["rows"]
    assert row["precision"] == "float32" and row["attention_calls"] > 0 and row["varlen_calls"] == 0


def test_lora_rows_train_adapters_over_shared_weights():
    """--lora: the policy is a peft model, with no reference model (adapters off); every mode's trainer holds the
    same weight storage, so a mode's peak memory counts one run's weights."""
    from trl_padfree.cli.bench.precision import PRECISIONS
    from trl_padfree.cli.bench.rows import build_trainers

    options = argparse.Namespace(
        model="tiny", lora=True, backends=["padfree_varlen"], prefix_sharing="auto", activation_checkpointing=True
    )
    trainers = build_trainers(options, PRECISIONS["trl_default"], torch.device("cpu"))
    assert list(trainers) == [None, "padfree_varlen", PREFIX_SHARING_AUTO]
    storages = set()
    for trainer in trainers.values():
        assert trainer.ref_model is None and trainer.args.bf16
        trained = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
        assert trained and all("lora_" in name for name in trained)
        embedding = trainer.model.get_input_embeddings().weight
        assert embedding.dtype == torch.float32
        storages.add(embedding.untyped_storage().data_ptr())
    assert len(storages) == 1


def test_precision_and_lora_are_refused_outside_the_text_bench():
    with pytest.raises(SystemExit):  # the CLI's one-line error
        main(["bench", "--batching", "--precision", "bf16"])


def _assert_spread_host_time_and_flops(row: dict, warmup: int, steps: int) -> None:
    assert row["warmup_steps"] == warmup and row["batches"] == steps
    for mode in ("padded", "padfree"):
        times = row[f"{mode}_step_times_s"]
        assert len(times) == len(row[f"{mode}_host_times_s"]) == steps
        assert min(times) <= row[f"{mode}_step_s_median"] <= max(times)
        assert row[f"{mode}_step_s"] == pytest.approx(sum(times) / steps)
        assert row[f"{mode}_host_step_s"] > 0 and row[f"{mode}_host_bound"] is None  # no marker on CPU
    assert row["speedup_per_batch_min"] <= row["speedup_per_batch_median"] <= row["speedup_per_batch_max"]
    assert row["padded_step_flops"] >= row["padfree_step_flops"] > 0  # equal where no pair needed padding
    assert row["flop_ideal_speedup"] == pytest.approx(row["padded_step_flops"] / row["padfree_step_flops"])
    assert row["fraction_of_flop_ideal"] == pytest.approx(row["speedup"] / row["flop_ideal_speedup"])
    assert row["fraction_of_ideal"] == pytest.approx(row["speedup"] / row["ideal_speedup"])


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
    (row,) = json.loads(output.read_text())["rows"]
    assert row["pairs"] == 6 and row["fixed_steps_per_epoch"] == 2 and row["budget_steps_per_epoch"] <= 2
    assert row["fixed_tokens_per_s"] > 0 and row["budget_tokens_per_s"] > 0 and 0 < row["budget_fill"] <= 1
    assert "| ultrafeedback | 6 | 3 |" in capsys.readouterr().out


def test_vision_run_counts_the_images_each_mode_encodes(tmp_path, capsys):
    output = tmp_path / "vision.json"
    args = ["bench", "--vision", "--device", "cpu", "--batches", "1", "--warmup", "0", "--pairs-per-batch", "3"]
    assert main([*args, "--output", str(output)]) == 0
    rows = {row["mode"]: row for row in json.loads(output.read_text())["rows"]}
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


# ---------------------------------------------------------------------------------------------------------------------
# Step counts and the timed steps' structure


@pytest.mark.parametrize(
    "device, quick, expected", [("cuda", False, (3, 20)), ("cpu", False, (1, 8)), ("cpu", True, (1, 3))]
)
def test_default_step_counts_per_device(device, quick, expected):
    def counts(warmup, steps):
        options = argparse.Namespace(
            device=device, quick=quick, warmup=warmup, batches=steps, pairs_per_batch=8, max_length=1024
        )
        set_step_counts(options)
        return options.warmup, options.batches

    assert counts(None, None) == expected
    assert counts(0, 5) == (0, 5)  # given counts are kept


def test_zero_measured_steps_are_refused():
    with pytest.raises(SystemExit):  # the CLI's one-line error
        main(["bench", "--steps", "0"])


class _FakeCudaEvent:
    def __init__(self, log, enable_timing=False):
        self.log = log

    def record(self, stream=None):
        self.log.append("event")

    def elapsed_time(self, other):
        return 2.0  # milliseconds


class _FakeTrainer:
    """What the harness touches of a trainer, logging its step."""

    def __init__(self, log):
        self.log = log
        self.model = torch.nn.Linear(1, 1)
        self.data_collator = lambda batch: batch

    def training_step(self, model, inputs):
        self.log.append("step")


def test_no_cache_is_emptied_inside_the_timed_steps(monkeypatch):
    """The CUDA path of the timer, with CUDA's calls logged: `empty_cache` runs once, before every mode's warm-ups,
    never between a measured step's opening synchronisation and its closing one, nor between measured steps."""
    log = []
    fakes = dict(
        empty_cache=lambda: log.append("empty_cache"),
        synchronize=lambda device=None: log.append("synchronize"),
        reset_peak_memory_stats=lambda device=None: log.append("reset_peak"),
        max_memory_allocated=lambda device=None: 3 * 2**20,
        Event=lambda enable_timing=False: _FakeCudaEvent(log, enable_timing),
    )
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(harness, "cuda_sync_blocks", lambda device: True)
    monkeypatch.setattr(harness.gc, "collect", lambda: 0)  # a full collection per step: seconds in a test process
    trainer, modes = _FakeTrainer(log), ("padded", "padfree")
    timer = StepTimer(torch.device("cuda"), modes)
    timer.warm_up((trainer, ["warm-up batch"]) for _mode in modes for _ in range(3))
    warm_up_log, log[:] = list(log), []
    for index in range(4):
        for mode in modes if index % 2 == 0 else reversed(modes):
            timer.step(mode, trainer, ["batch"])

    one_step = ["reset_peak", "synchronize", "event", "step", "event", "synchronize"]
    assert warm_up_log == ["empty_cache"] + 3 * one_step * 2  # emptied once, before every mode's warm-ups
    assert log == one_step * 8  # measured: no empty_cache anywhere
    stats = timer.stats("padded")
    assert stats.times_s == [0.002] * 4 and len(stats.host_times_s) == 4 and stats.peak_mb == 3.0
    assert stats.host_bound is False  # the fake step does no host work against 2 ms of "GPU" time


def test_host_bound_marks_a_step_whose_host_time_nears_its_time(monkeypatch):
    monkeypatch.setattr(harness, "cuda_sync_blocks", lambda device: True)
    timer = StepTimer(torch.device("cuda"), ["launch-bound", "compute-bound"])
    timer.times_s = {"launch-bound": [1.0, 1.0], "compute-bound": [1.0, 1.0]}
    timer.host_times_s = {"launch-bound": [0.8, 0.85], "compute-bound": [0.3, 0.9]}
    assert timer.stats("launch-bound").host_bound is True
    assert timer.stats("compute-bound").host_bound is False  # 0.6 of the steps' time
    monkeypatch.setattr(harness, "cuda_sync_blocks", lambda device: False)  # a spinning wait counts as host time
    assert StepTimer(torch.device("cuda"), ["a"]).host_time_is_work is False
    assert StepTimer(torch.device("cpu"), ["a"]).stats("a").host_bound is None


# ---------------------------------------------------------------------------------------------------------------------
# The FLOP model (trl_padfree/costs/flops.py), on hand-computed cases


def prefix_shared_segments(prompt: int, chosen: int, rejected: int) -> list[Segment]:
    """A pair laid out with prefix sharing: the prompt once, followed by the chosen completion (one causal segment),
    then the rejected completion reading the prompt::

        row: [ p p p c c ][ r r r ]
              segment 1     segment 2, keys: p p p + r r r
    """
    return [Segment(prompt + chosen), Segment(rejected, prefix=prompt)]


def test_causal_pairs_count_each_query_over_its_keys():
    assert causal_pairs(1) == 1 and causal_pairs(3) == 1 + 2 + 3
    assert causal_pairs(2, prefix=4) == (4 + 1) + (4 + 2)  # each branch token reads the 4 prefix tokens and itself
    assert prefix_shared_segments(prompt=5, chosen=3, rejected=2) == [Segment(8), Segment(2, prefix=5)]


def test_packed_and_padded_work():
    # Row [a a a | b b] with b reading a 4-token prefix, 4 scored tokens, a 3-token padding segment at the end
    assert packed_row_work([3, Segment(2, prefix=4)], scored_tokens=4) == BatchWork(5, 4, 6 + 11)
    assert packed_row_work([3, Segment(2, prefix=4)], scored_tokens=4, row_tokens=8).tokens == 8
    # Two sequences of 3 and 5 padded to 5: 10 tokens, two full 5 x 5 squares under the padding mask
    assert padded_batch_work([3, 5], scored_tokens=4) == BatchWork(10, 4, 2 * 25)
    assert padded_batch_work([3, 5], scored_tokens=4, padded_length=8) == BatchWork(16, 4, 2 * 64)
    assert padded_batch_work([4, 4], scored_tokens=2) == BatchWork(8, 2, 2 * 10)  # no padding, no mask: causal
    assert BatchWork(1, 2, 3) + BatchWork(10, 20, 30) == BatchWork(11, 22, 33)
    assert sum([BatchWork(1, 1, 1)] * 3, BatchWork()) == BatchWork(3, 3, 3)


TOY_SHAPE = DecoderShape(
    linear_params=10, hidden_size=2, vocab_size=3, attention_layers=2, num_attention_heads=2, head_dim=4
)


def test_flops_of_a_forward_and_a_training_step():
    work = BatchWork(tokens=5, scored_tokens=4, attention_pairs=17)
    linear, lm_head, attention = 10 * 5, (2 * 3) * 4, 2 * (2 * 4) * 17 * 2  # QK^T and PV x heads x head_dim x layers
    assert forward_flops(TOY_SHAPE, work) == 2 * (linear + lm_head + attention) == 1236
    assert training_step_flops(TOY_SHAPE, work) == 4 * 1236  # policy forward + backward (3) + reference (1)
    assert training_step_flops(TOY_SHAPE, work, reference_forward=False) == 3 * 1236
    padded = padded_batch_work([3, 5], scored_tokens=4)  # 10 tokens, 50 pairs
    packed = packed_row_work([3, 5], scored_tokens=4)  # 8 tokens, 6 + 15 pairs
    expected = (10 * 10 + 24 + 16 * 50 * 2) / (10 * 8 + 24 + 16 * 21 * 2)
    assert flop_ideal_speedup(TOY_SHAPE, padded, packed) == pytest.approx(expected)


def test_decoder_shape_from_a_config_dense_and_mixture_of_experts():
    dense = SimpleNamespace(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
        intermediate_size=16, vocab_size=10,
    )  # fmt: skip
    attention = 8 * 4 * (2 + 2 * 1 + 2)  # q and o: 2 heads; k and v: 1 head; of 4 x 8 each
    assert DecoderShape.from_config(dense) == DecoderShape(
        linear_params=2 * (attention + 3 * 8 * 16), hidden_size=8, vocab_size=10, attention_layers=2,
        num_attention_heads=2, head_dim=4, num_key_value_heads=1,
    )  # fmt: skip
    # Layer 0 dense (Qwen-MoE's mlp_only_layers); layer 1: router over 4 experts, 2 routed experts of 6, 1 shared
    moe = SimpleNamespace(**vars(dense), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6)
    moe.mlp_only_layers, moe.n_shared_experts = [0], 1
    routed_layer = attention + 8 * 4 + 3 * 8 * (2 * 6 + 6)
    assert DecoderShape.from_config(moe).linear_params == (attention + 3 * 8 * 16) + routed_layer
    hybrid = SimpleNamespace(**vars(dense), layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"not \['linear_attention'\]: pass linear_params"):
        DecoderShape.from_config(hybrid)
    assert DecoderShape.from_config(hybrid, linear_params=99).attention_layers == 1


def test_bench_model_shape_counts_the_layers_parameters():
    # The demo Llama: the config's formula plus the RMSNorm weights (2 per layer and the final one) it leaves out
    model = make_bench_model("tiny", "sdpa", torch.float32)
    counted, from_config = decoder_shape(model), DecoderShape.from_config(model.config)
    assert counted.linear_params - from_config.linear_params == 64 * (2 * 2 + 1)
    assert counted.attention_layers == 2 and counted.vocab_size == 2048


def test_batch_work_reads_the_collated_layout():
    padded = {
        "input_ids": torch.zeros(2, 5, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
        "completion_mask": torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]),
    }
    assert batch_work(padded) == BatchWork(tokens=10, scored_tokens=5, attention_pairs=50)
    # Prefix sharing: chosen sequence of 6 (prompt 3 + 3), rejected of 5 reading those 3 prompt tokens: a 2-token branch
    shared = {
        "input_ids": torch.zeros(1, 8, dtype=torch.long),
        "completion_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]),
        "seq_lens": torch.tensor([6, 5]),
        "shared_prefix_lens": torch.tensor([0, 3]),
        HOST_ROW: HostRow((0, 6, 8), (6, 5), (0, 6), (0, 0), (0, 3)),
    }
    assert batch_work(shared) == BatchWork(tokens=8, scored_tokens=5, attention_pairs=21 + (2 * 3 + 3))
    # A prompt group: the rejected sequence of the second pair is the first pair's rejected one, counted once
    grouped = concatenated_inputs(
        [{"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 10], "rejected_ids": [11, 12]},
         {"prompt_ids": [5, 6, 7], "chosen_ids": [13], "rejected_ids": [11, 12]}],
        prefix_sharing=True, prefix_sharing_min_prompt_tokens=2,
    )  # fmt: skip
    # [5 6 7 8 9 10] [7 11 12] [7 13], each branch reading the prompt's first 2 tokens: 21 + (3 x 2 + 6) + (2 x 2 + 3)
    # pairs; the row's completion tokens scored once each
    assert batch_work(grouped) == BatchWork(tokens=11, scored_tokens=6, attention_pairs=21 + 12 + 7)


def test_the_flop_model_imports_the_standard_library_only():
    """Reusable in a cost model or a launcher without torch: its imports are the standard library's."""
    tree = ast.parse(Path(flops.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} <= set(sys.stdlib_module_names)


def test_prompt_group_batches_hold_each_prompts_six_pairs_with_shared_completions():
    batches = make_batches("prompt_groups", num_batches=2, pairs_per_batch=6, max_length=1024, vocab_size=2048, seed=3)
    for batch in batches:  # one prompt's 4 completions paired all ways, a batch of 6 pairs holding one prompt
        assert len({tuple(pair["prompt_ids"]) for pair in batch}) == 1
        completions = {tuple(pair[side]) for pair in batch for side in ("chosen_ids", "rejected_ids")}
        assert len(completions) == 4
