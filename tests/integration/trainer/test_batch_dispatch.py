"""Batches accelerate dispatches or splits, streamed datasets, and Liger: packed batches are built by each process
and never sliced by accelerate (trainer._keep_batches_whole), and what cannot carry them is refused.

accelerate's DataLoaderDispatcher (its default for streamed datasets, or `dispatch_batches=True`) slices every tensor
of a batch to the first tensor's batch size: a packed row has batch size 1, so its per-sequence `seq_lens` and
`cu_seq_lens` were cut to one element and evaluation crashed in the metrics.
"""

import pytest
from tolerances import METRIC_ATOL, METRIC_RTOL
from trainer_utils import make_trainer


def assert_same_metrics(padded: dict, packed: dict) -> None:
    assert set(padded) <= set(packed)
    for key, value in padded.items():
        if key.endswith(("_runtime", "_per_second")):
            continue
        assert packed[key] == pytest.approx(value, rel=METRIC_RTOL * 10, abs=METRIC_ATOL), key


def test_streamed_evaluation_matches_padded():
    # A map-style training set and a streamed eval set: TRL leaves dispatch_batches unset, and accelerate would
    # dispatch the eval batches
    padded = make_trainer(False, streamed=("eval",)).evaluate()
    trainer = make_trainer(True, streamed=("eval",))

    assert trainer.accelerator.dataloader_config.dispatch_batches is False  # each process builds its own rows
    assert_same_metrics(padded, trainer.evaluate())


def test_streamed_training_matches_padded():
    options = dict(streamed=("train", "eval"), max_steps=2, logging_steps=1, batch_size=4)
    padded = make_trainer(False, **options)
    packed = make_trainer(True, **options)
    padded.train()
    packed.train()

    padded_losses = [entry["loss"] for entry in padded.state.log_history if "loss" in entry]
    packed_losses = [entry["loss"] for entry in packed.state.log_history if "loss" in entry]
    assert len(packed_losses) == 2
    assert packed_losses == pytest.approx(padded_losses, rel=1e-5)


@pytest.mark.parametrize(
    "accelerator_config, message",
    [
        ({"dispatch_batches": True}, "dispatch_batches=True cannot carry packed batches"),
        ({"split_batches": True}, "split_batches=True cannot split a packed batch"),
    ],  # fmt: skip
)
def test_dispatched_or_split_batches_are_refused(accelerator_config, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(True, accelerator_config=accelerator_config)


def test_liger_kernel_is_refused_at_construction():
    # Before TRL's own import of liger-kernel: the refusal does not depend on it being installed
    with pytest.raises(ValueError, match="use_liger_kernel=True cannot train padding-free"):
        make_trainer(True, use_liger_kernel=True)
