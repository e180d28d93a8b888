"""A vision-language set's pairs priced once per dataset (packing/pair_sizes.py): counted from image sizes as
collating counts them, shared over gloo processes as one process prices them, cached and read back without
collating, and recomputed when anything that changes a row changes or the file is not the one it should be."""

import logging
import subprocess
import sys

import datasets
import pytest
import torch
from distributed import price_pairs
from distributed_runs import ROOT, checkout_environment, free_port
from tiny_vision import make_vision_processor, vision_preference_rows

from trl_padfree.integrations.transformers import counts_image_tokens_from_sizes
from trl_padfree.packing import pair_sizes as priced
from trl_padfree.packing.balanced_batches import BalancedBatchSampler
from trl_padfree.packing.token_budget import TokenBudgetBatchSampler
from trl_padfree.packing.units import PairUnits
from trl_padfree.packing.vision import PaddingFreeVisionPreferenceCollator

# Odd image sizes (thin, tiny, wide), no image, several images per pair
SIZES = [(17, 33), (64, 64), (90, 41), (13, 130), (200, 150)]


def collator_of(family, **options):
    return PaddingFreeVisionPreferenceCollator(**{"processor": make_vision_processor(family), **options})


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"])
@pytest.mark.parametrize(
    "options", [{}, dict(prefix_sharing=True), dict(max_length=64)], ids=["row", "shared-prefix", "max_length"]
)
def test_image_tokens_counted_from_sizes_equal_the_collated_ones(family, options):
    collator = collator_of(family, **options)
    assert counts_image_tokens_from_sizes(collator.processor)
    rows = vision_preference_rows(family, 10, seed=3, images_per_row=[1, 0, 2, 3], sizes=SIZES)
    for row in rows:
        try:
            collated = priced.collated_sizes(dict(row), collator)
        except ValueError as refusal:  # max_length cutting an image: refused the same way
            with pytest.raises(ValueError, match=str(refusal).split(":")[0]):
                priced.counted_sizes(dict(row), collator)
            continue
        assert priced.counted_sizes(dict(row), collator) == collated


def test_processors_that_write_text_around_their_tokens_are_collated():
    assert not counts_image_tokens_from_sizes(make_vision_processor("gemma3"))
    assert not counts_image_tokens_from_sizes(make_vision_processor("llava_next"))


class CountingCollator(PaddingFreeVisionPreferenceCollator):
    calls = 0

    def torch_call(self, examples):
        CountingCollator.calls += 1
        return super().torch_call(examples)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    return tmp_path


def counting_collator(family="gemma3", **options):
    CountingCollator.calls = 0
    return CountingCollator(processor=make_vision_processor(family), **options)


def test_a_second_construction_reads_the_cache_without_collating(cache_dir):
    dataset = datasets.Dataset.from_list(vision_preference_rows("gemma3", 6, sizes=SIZES))
    first = priced.pair_sizes(dataset, counting_collator(), show_progress=False)
    assert CountingCollator.calls == 6 and len(list(cache_dir.glob("trl_padfree_pair_sizes/*.pt"))) == 1

    again = priced.pair_sizes(dataset, counting_collator(), show_progress=False)
    assert CountingCollator.calls == 0 and again.equal(first)

    # The same data loaded again (same fingerprint) reads it too; other data, or another setting, does not
    reloaded = datasets.Dataset.from_list(vision_preference_rows("gemma3", 6, sizes=SIZES))
    assert reloaded._fingerprint == dataset._fingerprint
    priced.pair_sizes(reloaded, counting_collator(), show_progress=False)
    assert CountingCollator.calls == 0
    shorter = priced.pair_sizes(dataset, counting_collator(max_length=30), show_progress=False)
    assert CountingCollator.calls == 6 and not shorter.equal(first)
    priced.pair_sizes(dataset, counting_collator(prefix_sharing=True), show_progress=False)
    assert CountingCollator.calls == 6
    other = datasets.Dataset.from_list(vision_preference_rows("gemma3", 6, seed=1, sizes=SIZES))
    priced.pair_sizes(other, counting_collator(), show_progress=False)
    assert CountingCollator.calls == 6


def test_another_processor_misses_the_cache(cache_dir):
    dataset = datasets.Dataset.from_list(vision_preference_rows("qwen2_5_vl", 4, sizes=SIZES))
    big = priced.pair_sizes(dataset, collator_of("qwen2_5_vl"), show_progress=False)
    small_images = collator_of("qwen2_5_vl", processor=make_vision_processor("qwen2_5_vl", max_pixels=2 * 28 * 28))
    small = priced.pair_sizes(dataset, small_images, show_progress=False)
    assert small[:, 0].sum() < big[:, 0].sum()


@pytest.mark.parametrize("damage", ["truncated", "other key", "edited sizes"])
def test_a_damaged_or_foreign_cache_file_is_recomputed_never_used(cache_dir, damage, caplog):
    dataset = datasets.Dataset.from_list(vision_preference_rows("gemma3", 5, sizes=SIZES))
    sizes = priced.pair_sizes(dataset, counting_collator(), show_progress=False)
    (path,) = cache_dir.glob("trl_padfree_pair_sizes/*.pt")
    stored = torch.load(path, weights_only=True)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "other key":
        torch.save({**stored, "key": {**stored["key"], "pairs": 4}}, path)
    else:
        torch.save({**stored, "sizes": stored["sizes"] + 1}, path)
    with caplog.at_level(logging.WARNING, logger=priced.__name__):
        again = priced.pair_sizes(dataset, counting_collator(), show_progress=False)
    assert CountingCollator.calls == 5 and again.equal(sizes)
    assert "is not used" in caplog.text
    assert torch.load(path, weights_only=True)["sizes"].equal(sizes)  # rewritten


def test_no_cache_without_a_fingerprint_or_with_caching_disabled(cache_dir):
    rows = vision_preference_rows("gemma3", 3, sizes=SIZES)
    priced.pair_sizes(rows, counting_collator(), show_progress=False)  # a list: no fingerprint
    datasets.disable_caching()
    try:
        priced.pair_sizes(datasets.Dataset.from_list(rows), counting_collator(), show_progress=False)
    finally:
        datasets.enable_caching()
    assert not list(cache_dir.rglob("*.pt"))


def test_shares_priced_on_two_gloo_processes_equal_one_process_pricing(tmp_path):
    script, port = ROOT / "tests" / "support" / "distributed" / "price_pairs.py", free_port()
    runs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", str(port), str(tmp_path)], env=checkout_environment()
        )
        for rank in (0, 1)
    ]
    datasets.disable_caching()
    try:
        price_pairs.main(0, 1, port, tmp_path / "alone")  # this process alone, meanwhile
    finally:
        datasets.enable_caching()
    assert [run.wait(timeout=300) for run in runs] == [0, 0]
    for family in price_pairs.FAMILIES:
        alone = torch.load(tmp_path / "alone" / f"rank0-{family}.pt")
        shared = [torch.load(tmp_path / f"rank{rank}-{family}.pt") for rank in (0, 1)]
        assert alone.shape == (price_pairs.PAIRS, 4) and (alone >= 0).all()
        assert shared[0].equal(alone) and shared[1].equal(alone)
        # ... so every process builds the batches one process builds
        costs = [float(cost) for cost in priced.lengths_of(shared[1])]
        alone_costs = [float(cost) for cost in priced.lengths_of(alone)]
        sampler = BalancedBatchSampler(PairUnits(costs), 2, processes=2, micro_steps=2, seed=0)
        assert list(sampler) == list(
            BalancedBatchSampler(PairUnits(alone_costs), 2, processes=2, micro_steps=2, seed=0)
        )
        budget = TokenBudgetBatchSampler(PairUnits(priced.lengths_of(shared[1])), 400, seed=0, num_processes=2)
        assert (
            budget.bins
            == TokenBudgetBatchSampler(PairUnits(priced.lengths_of(alone)), 400, seed=0, num_processes=2).bins
        )
