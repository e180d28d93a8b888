"""The swap-in's promises: with `padding_free=False` and this package's options unset, `trl_padfree.DPOTrainer` is
TRL's trainer, bit for bit (one step in fp32 and under bf16 autocast, and a short training run's logs; FSDP2 bf16 on
two processes is in tests/integration/fsdp/test_fsdp.py); `fp32_log_probs` follows `padding_free` unless set; with `padding_free=True`
the trainer logs its real tokens per second and records its settings in the model card."""

import re
import time

import pytest
import torch
import trl
from trainer_utils import make_trainer, one_step
from transformers import HfArgumentParser, TrainerCallback

from trl_padfree import DPOConfig
from trl_padfree.features.padding_free import padding_removed
from trl_padfree.settings import Settings

# The Trainer's wall-clock figures: the only logged values two identical runs do not share
TIMINGS = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def trl_trainer(**options):
    return make_trainer(False, trainer_class=trl.DPOTrainer, config_class=trl.DPOConfig, **options)


@pytest.mark.parametrize("precision", [{}, {"bf16": True}], ids=["fp32", "bf16_autocast"])
def test_padding_free_false_is_trl_exactly_on_one_step(precision):
    ours = one_step(make_trainer(False, **precision))
    theirs = one_step(trl_trainer(**precision))
    assert ours.loss == theirs.loss and ours.metrics == theirs.metrics
    assert ours.grads.keys() == theirs.grads.keys()
    for name, grad in theirs.grads.items():
        assert torch.equal(ours.grads[name], grad), name


def test_padding_free_false_trains_and_logs_as_trl():
    # Through train(): the dataloader, the optimizer steps, the logs (no padfree/ metric among them)
    options = dict(num_pairs=8, batch_size=2, max_steps=3, logging_steps=1, learning_rate=0.1, bf16=True)
    ours, theirs = make_trainer(False, **options), trl_trainer(**options)
    ours.train()
    theirs.train()

    def logs(trainer):
        return [{k: v for k, v in entry.items() if k not in TIMINGS} for entry in trainer.state.log_history]

    assert logs(ours) == logs(theirs) and len(logs(ours)) == 4  # 3 steps and the summary


def test_fp32_log_probs_is_on_exactly_when_packing_unless_set():
    assert DPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to=[]).fp32_log_probs is None
    for padding_free in (False, True):
        config = DPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to=[], padding_free=padding_free)
        assert Settings.resolve(config).fp32_log_probs is padding_free
    for value in (True, False):
        for padding_free in (False, True):
            config = DPOConfig(
                output_dir="/tmp/unused", use_cpu=True, report_to=[], padding_free=padding_free, fp32_log_probs=value
            )
            assert Settings.resolve(config).fp32_log_probs is value
    assert Settings.resolve(trl.DPOConfig(output_dir="/tmp/unused", use_cpu=True)).fp32_log_probs is False
    # A YAML file's value reaches the config as written
    assert (
        DPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to=[], fp32_log_probs="auto").fp32_log_probs is None
    )
    with pytest.raises(ValueError, match="fp32_log_probs must be true, false or unset"):
        DPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to=[], fp32_log_probs="sometimes")


def test_fp32_log_probs_on_the_command_line():
    parser = HfArgumentParser(DPOConfig)
    common = ["--output_dir", "/tmp/unused", "--use_cpu", "true", "--report_to", "none"]
    for argv, expected in (([], None), (["--fp32_log_probs", "true"], True), (["--fp32_log_probs", "false"], False)):
        (config,) = parser.parse_args_into_dataclasses(common + argv)
        assert config.fp32_log_probs is expected, argv
    help_text = " ".join(parser.format_help().split())
    assert "Unset: true with padding_free=True, false (TRL's behaviour) with padding_free=False" in help_text


class LogClock(TrainerCallback):
    """The host clock at every log, to check the logged rate against."""

    def __init__(self):
        self.times = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.times.append(time.perf_counter())


def test_tokens_per_second_is_logged_at_each_training_log():
    trainer = make_trainer(True, num_pairs=16, batch_size=2, max_steps=4, logging_steps=1, eval_strategy="no")
    clock = LogClock()
    trainer.add_callback(clock)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 4 and all(entry["padfree/tokens_per_second"] > 0 for entry in logged)
    # One process, one micro-batch per step, no prefix sharing: a step's row tokens are its real tokens. The rate's
    # seconds are the step's, within the time between two logs (the log and its callbacks are not counted)
    for entry, (start, end) in zip(logged[1:], zip(clock.times, clock.times[1:], strict=False), strict=True):
        between_logs = entry["padfree/real_tokens"] / (end - start)
        assert between_logs <= entry["padfree/tokens_per_second"] < 2 * between_logs
    assert "padfree/tokens_per_second" not in trainer.evaluate()  # a training figure only


def test_model_card_records_the_padding_free_settings_and_the_padding_removed(tmp_path):
    options = dict(num_pairs=8, batch_size=4, max_steps=2, logging_steps=1, max_tokens_per_batch=4096)
    trainer = make_trainer(True, output_dir=str(tmp_path), **options)
    trainer.train()
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert "trl-padfree" in card and "## Padding-free training (trl-padfree)" in card
    for setting, value in (
        ("padding_free", "True"),
        ("prefix_sharing", "False"),
        ("max_tokens_per_batch", "4096"),
        ("sequence_parallel_size", "1"),
        ("context_parallel_size", "1"),
        ("ref_offload", "False"),
    ):
        assert f"| `{setting}` | `{value}` |" in card, setting
    assert "padfree_varlen (policy, LlamaForCausalLM), padfree_varlen (reference, LlamaForCausalLM)" in card
    removed = padding_removed(trainer.state.log_history)
    assert 0 < removed < 1 and f"| padding removed | {removed:.1%} of the tokens" in card
    # From the logs: each log's mean real and padded tokens, summed
    logged = [entry for entry in trainer.state.log_history if "padfree/padded_tokens" in entry]
    expected = 1 - sum(e["padfree/real_tokens"] for e in logged) / sum(e["padfree/padded_tokens"] for e in logged)
    assert removed == pytest.approx(expected) and len(logged) == 2


def test_model_card_of_a_padded_run_says_so(tmp_path):
    trainer = make_trainer(False, output_dir=str(tmp_path))
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "| `padding_free` | `False` |" in card and "none (padded batches)" in card
    assert re.search(r"\| padding removed \| not measured", card)
