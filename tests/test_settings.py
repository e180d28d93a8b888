"""`Settings` (settings.py): the config resolved once, each option after its default and "auto"."""

import dataclasses

import pytest
import trl

from trl_padfree import DPOConfig, PaddingFreePreferenceCollator
from trl_padfree.packing.prefix_sharing import MIN_SHARED_PROMPT_TOKENS, PrefixSharing
from trl_padfree.settings import OWN_DEFAULTS, Settings


def config(config_class=DPOConfig, **options):
    return config_class(output_dir="/tmp/unused", use_cpu=True, report_to=[], **options)


def test_a_plain_trl_config_resolves_to_the_defaults_of_our_options():
    settings = Settings.resolve(config(trl.DPOConfig))
    assert settings == Settings(train_sampling_strategy=settings.train_sampling_strategy)
    assert settings.prefix_sharing is PrefixSharing.OFF and settings.ranks_per_row == 1
    assert Settings.resolve(None) == Settings()


def test_our_defaults_are_the_configs_own():
    # One home for each default: the config's fields, which the settings' defaults agree with
    defaults = Settings()
    for name, default in OWN_DEFAULTS.items():
        if name not in ("prefix_sharing", "fp32_log_probs"):  # resolved: an enum, and on exactly when packing
            assert getattr(defaults, name) == default, name
    assert defaults.prefix_sharing.value == OWN_DEFAULTS["prefix_sharing"]


@pytest.mark.parametrize(
    ("value", "sharing", "sized", "grouped"),
    [(False, PrefixSharing.OFF, None, None), (True, PrefixSharing.ON, 5, 5), ("auto", PrefixSharing.AUTO, None, 2)],
)
def test_prefix_sharing_is_one_of_three_with_what_sizes_and_groups_pairs(value, sharing, sized, grouped):
    settings = Settings.resolve(config(padding_free=True, prefix_sharing=value, prefix_sharing_min_prompt_tokens=5))
    assert settings.prefix_sharing is sharing and bool(sharing) == bool(value)
    assert settings.sized_min_prompt_tokens == sized  # "auto" sizes pairs unshared, the larger
    assert settings.grouped_min_prompt_tokens == grouped
    assert MIN_SHARED_PROMPT_TOKENS == 2


def test_a_packing_collators_prefix_sharing_counts_when_the_config_leaves_it_off():
    collator = PaddingFreePreferenceCollator(pad_token_id=0, prefix_sharing="auto", prefix_sharing_min_prompt_tokens=4)
    settings = Settings.resolve(config(padding_free=True), collator)
    assert (settings.prefix_sharing, settings.prefix_sharing_min_prompt_tokens) == (PrefixSharing.AUTO, 4)
    on = Settings.resolve(config(padding_free=True, prefix_sharing=True), collator)
    assert (on.prefix_sharing, on.prefix_sharing_min_prompt_tokens) == (PrefixSharing.ON, 8)  # the config's wins


def test_batching_and_parallel_sizes():
    settings = Settings.resolve(config(padding_free=True, max_tokens_per_batch=64, context_parallel_size=2))
    assert settings.uneven_batches == "max_tokens_per_batch" and settings.ranks_per_row == 2
    balanced = Settings.resolve(config(padding_free=True, train_sampling_strategy="batch_rebalance"))
    assert balanced.batch_rebalance and balanced.uneven_batches == "train_sampling_strategy='batch_rebalance'"
    assert Settings.resolve(config(train_sampling_strategy="group_by_prompt")).group_by_prompt


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().padding_free = True
