"""Packed forward equals per-sequence forwards on every tiny model type and backend; the attention checks; random
inputs and a reference for the `padfree_varlen` attention tests (tests/modeling/attention/test_attention.py).

The packed row of every model test (pad_to_multiple_of=8), chosen sequences then rejected ones:

    seq_lens      | 10 | 3 | 15 | 8 | 11 | 6 | pad 3 |
    cu_seq_lens   0    10  13   28  36   47  53      56

Four sequences are longer than the sliding window (6) of the mistral and gemma3_text configs, and two completions
are one token long.
"""

import pytest
import torch
from packed_rows import EXAMPLES, PACKED_KEYS, max_error, packed_log_probs, per_sequence_log_probs
from tiny_fixtures import make_model
from tolerances import BF16_LOG_PROB_ATOL, LOG_PROB_ATOL

from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION
from trl_padfree.modeling.backends import PACKING_AWARE as PACKING_AWARE_ATTENTION
from trl_padfree.modeling.check.packability import check_packable, resolve_attn_implementation
from trl_padfree.packing.collator import concatenated_inputs
from trl_padfree.refusals.models import check_attn_implementation
from trl_padfree.tiny import TINY_CONFIGS

TINY_MODEL_TYPES = tuple(TINY_CONFIGS)

BACKENDS = ("eager", "sdpa", ATTN_IMPLEMENTATION)

BF16_MODEL_TYPES = ("llama", "mistral")


@pytest.fixture(scope="module")
def packed_batch():
    batch = concatenated_inputs(EXAMPLES, pad_to_multiple_of=8)
    assert batch["seq_lens"].tolist() == [10, 3, 15, 8, 11, 6]
    assert batch["input_ids"].shape == (1, 56)
    return batch


@pytest.mark.parametrize("attn_implementation", BACKENDS)
@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_packed_forward_equals_per_sequence_forward(model_type, attn_implementation, packed_batch):
    model = make_model(model_type, attn_implementation=attn_implementation).eval()
    # Eager per-sequence forwards are the reference: a backend that dropped the sliding window in both its packed and
    # its per-sequence forward would still differ from them
    reference = per_sequence_log_probs(make_model(model_type, attn_implementation="eager").eval(), packed_batch)

    packed = packed_log_probs(model, packed_batch)

    assert max_error(packed, per_sequence_log_probs(model, packed_batch)) <= LOG_PROB_ATOL
    assert max_error(packed, reference) <= LOG_PROB_ATOL


@pytest.mark.parametrize("model_type", BF16_MODEL_TYPES)
def test_packed_forward_equals_per_sequence_forward_in_bf16(model_type, packed_batch):
    model = make_model(model_type, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.bfloat16).eval()
    reference = per_sequence_log_probs(
        make_model(model_type, attn_implementation="eager", dtype=torch.bfloat16).eval(), packed_batch
    )

    packed = packed_log_probs(model, packed_batch)

    assert max_error(packed, per_sequence_log_probs(model, packed_batch)) <= BF16_LOG_PROB_ATOL
    assert max_error(packed, reference) <= BF16_LOG_PROB_ATOL


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_a_leak_across_sequences_exceeds_the_tolerance_tenfold(model_type, packed_batch):
    # With an attention mask transformers reads the row as one sequence: each sequence sees the ones before it. The
    # tolerances (tests/support/tolerances.py) must sit far below what that costs, or the equality tests prove nothing
    model = make_model(model_type, attn_implementation="sdpa").eval()
    attention_mask = torch.ones_like(packed_batch["input_ids"])
    with torch.no_grad():
        leaky = model(
            **{key: packed_batch[key] for key in PACKED_KEYS}, attention_mask=attention_mask, use_cache=False
        )
    num_real_tokens = int(packed_batch["seq_lens"].sum())

    error = max_error(leaky.logits.log_softmax(-1)[0, :num_real_tokens], per_sequence_log_probs(model, packed_batch))

    loosest_tolerance = BF16_LOG_PROB_ATOL if model_type in BF16_MODEL_TYPES else LOG_PROB_ATOL
    assert error > 10 * loosest_tolerance


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_the_sliding_window_is_in_effect(model_type, packed_batch):
    # Otherwise the sliding-window models would test nothing more than llama
    windowed = make_model(model_type, attn_implementation="eager").eval()
    unwindowed = make_model(model_type, attn_implementation="eager", sliding_window=4096).eval()

    error = max_error(per_sequence_log_probs(windowed, packed_batch), per_sequence_log_probs(unwindowed, packed_batch))

    assert error > 1e-2


# ---- checks.py: which attention implementations may pack ----


def test_check_packable_refuses_flex_attention():
    model = make_model("llama", attn_implementation="sdpa")
    model.config._attn_implementation = "flex_attention"

    with pytest.raises(ValueError, match="attn_implementation='flex_attention'"):
        check_packable(model)


@pytest.mark.parametrize("attn_implementation", PACKING_AWARE_ATTENTION)
def test_check_attn_implementation_accepts_the_packing_aware_ones(attn_implementation):
    check_attn_implementation(attn_implementation, PACKING_AWARE_ATTENTION)


@pytest.mark.parametrize("attn_implementation", ["flex_attention", "paged_attention", None])
def test_check_attn_implementation_refuses_the_others(attn_implementation):
    with pytest.raises(ValueError, match="not known to keep packed sequences apart"):
        check_attn_implementation(attn_implementation, PACKING_AWARE_ATTENTION)


@pytest.mark.parametrize(
    "requested, current, expected",
    [
        pytest.param("auto", "sdpa", ATTN_IMPLEMENTATION, id="auto-from-sdpa"),
        pytest.param("auto", "eager", ATTN_IMPLEMENTATION, id="auto-from-eager"),
        pytest.param("auto", None, ATTN_IMPLEMENTATION, id="auto-from-none"),
        pytest.param("auto", "flash_attention_2", "flash_attention_2", id="auto-keeps-fa2"),
        pytest.param("auto", "flash_attention_3", "flash_attention_3", id="auto-keeps-fa3"),
        pytest.param("keep", "sdpa", "sdpa", id="keep-sdpa"),
        pytest.param("keep", "flex_attention", "flex_attention", id="keep-flex"),
        pytest.param("eager", "flash_attention_2", "eager", id="explicit-eager"),
        pytest.param(ATTN_IMPLEMENTATION, "sdpa", ATTN_IMPLEMENTATION, id="explicit-padfree"),
    ],
)
def test_resolve_attn_implementation(requested, current, expected):
    assert resolve_attn_implementation(requested, current) == expected


# ---- attention.py: the padfree_varlen mask function, seen through a model ----


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2"])  # gemma3_text: sliding and full masks
def test_a_padfree_varlen_model_refuses_a_padded_batch(model_type):
    model = make_model(model_type, attn_implementation=ATTN_IMPLEMENTATION).eval()
    input_ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    attention_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])

    with pytest.raises(ValueError, match="got a padded batch"):
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2"])
def test_a_padfree_varlen_model_ignores_an_all_ones_mask_on_a_packed_row(model_type, packed_batch):
    # No padding, so nothing to honour: the segments still come from the packed position_ids
    model = make_model(model_type, attn_implementation=ATTN_IMPLEMENTATION).eval()
    num_real_tokens = int(packed_batch["seq_lens"].sum())
    with torch.no_grad():
        masked = model(
            input_ids=packed_batch["input_ids"],
            position_ids=packed_batch["position_ids"],
            attention_mask=torch.ones_like(packed_batch["input_ids"]),
            use_cache=False,
        ).logits.log_softmax(-1)[0, :num_real_tokens]

    assert max_error(masked, packed_log_probs(model, packed_batch)) <= LOG_PROB_ATOL


def test_a_vision_language_config_without_its_vision_tower_gets_the_verdict_of_its_text_model(tmp_path):
    # transformers' default Gemma4Config() leaves its vision tower out: Gemma4ForConditionalGeneration then builds its
    # language model alone, which padded TRL trains on text. `models --check` judges that, not a twin it cannot build
    import transformers
    from transformers import Gemma4Config

    from trl_padfree.cli.models import check_pretrained
    from trl_padfree.modeling.check.packability import check_architecture

    Gemma4Config().save_pretrained(tmp_path)
    answer = check_pretrained(str(tmp_path), backends=(ATTN_IMPLEMENTATION,))
    assert "Gemma4ForConditionalGeneration" in answer and "no vision tower in its config: a text model" in answer
    assert "packs exactly" in answer and "Error" not in answer, answer
    on_images = check_architecture(transformers.Gemma4ForConditionalGeneration, Gemma4Config(), "sdpa", images=True)
    assert not on_images.exact and on_images.reason.startswith("its config has no vision tower (vision_config=None)")
