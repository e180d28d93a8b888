"""The `padfree_varlen` attention function itself, on random inputs (`random_qkv` of tests/test_models.py) against
naive block-diagonal attention, and its refusals."""

import pytest
import torch
from test_models import ATTENTION_LENGTHS, HEAD_DIM, block_diagonal_attention, random_qkv

from trl_padfree.attention import padfree_varlen_attention
from trl_padfree.packing import cu_seq_lens_from_lengths, position_ids_from_lengths


def call_padfree_varlen(query, key, value, attention_mask=None, **kwargs):
    return padfree_varlen_attention(
        torch.nn.Module(), query, key, value, attention_mask, scaling=HEAD_DIM**-0.5, **kwargs
    )


def with_cu_seq_lens(lengths):
    cu_seq_lens = cu_seq_lens_from_lengths(lengths)
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": max(lengths)}


@pytest.mark.parametrize("sliding_window", [None, 3], ids=["causal", "window-3"])
def test_padfree_varlen_equals_block_diagonal_attention(sliding_window):
    query, key, value = random_qkv()

    output, weights = call_padfree_varlen(
        query, key, value, sliding_window=sliding_window, **with_cu_seq_lens(ATTENTION_LENGTHS)
    )

    assert weights is None
    expected = block_diagonal_attention(query, key, value, ATTENTION_LENGTHS, sliding_window)
    torch.testing.assert_close(output, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 3], ids=["causal", "window-3"])
def test_padfree_varlen_derives_boundaries_from_position_ids(sliding_window):
    query, key, value = random_qkv()

    from_cu_seq_lens, _ = call_padfree_varlen(
        query, key, value, sliding_window=sliding_window, **with_cu_seq_lens(ATTENTION_LENGTHS)
    )
    from_positions, _ = call_padfree_varlen(
        query, key, value, sliding_window=sliding_window, position_ids=position_ids_from_lengths(ATTENTION_LENGTHS)
    )

    assert torch.equal(from_positions, from_cu_seq_lens)


def test_padfree_varlen_refuses_an_attention_mask():
    query, key, value = random_qkv()
    attention_mask = torch.ones(1, 1, query.shape[2], query.shape[2], dtype=torch.bool)

    with pytest.raises(ValueError, match="takes no attention mask"):
        call_padfree_varlen(query, key, value, attention_mask, **with_cu_seq_lens(ATTENTION_LENGTHS))


@pytest.mark.parametrize(
    "boundaries",
    [
        pytest.param(lambda: with_cu_seq_lens([5, 10, 5, 10]), id="cu-seq-lens"),
        pytest.param(lambda: {"position_ids": position_ids_from_lengths([5, 10]).repeat(2, 1)}, id="position-ids"),
    ],
)
def test_padfree_varlen_refuses_more_than_one_row(boundaries):
    query, key, value = random_qkv(num_rows=2)

    with pytest.raises(ValueError, match="one packed row"):
        call_padfree_varlen(query, key, value, **boundaries())


def test_padfree_varlen_refuses_a_call_without_boundaries():
    query, key, value = random_qkv()

    with pytest.raises(ValueError, match="needs `cu_seq_lens_q` or the `position_ids`"):
        call_padfree_varlen(query, key, value)


def test_padfree_varlen_refuses_softcapping():
    query, key, value = random_qkv()

    with pytest.raises(ValueError, match="softcapping"):
        call_padfree_varlen(query, key, value, softcap=50.0, **with_cu_seq_lens(ATTENTION_LENGTHS))


def test_padfree_varlen_refuses_non_causal_attention():
    query, key, value = random_qkv()
    encoder_attention = torch.nn.Module()
    encoder_attention.is_causal = False

    with pytest.raises(ValueError, match="only supports causal"):
        padfree_varlen_attention(encoder_attention, query, key, value, None, **with_cu_seq_lens(ATTENTION_LENGTHS))
