"""Context parallelism (all-gather-KV attention over packed rows): the attention of every rank's chunk, put back
together, equals `padfree_varlen` on the whole row; here in one process, each rank's gather handed the whole row's
keys and values. The multi-process runs over gloo are further down."""

import pytest
import torch

from trl_padfree.attention import padfree_varlen_attention
from trl_padfree.context_parallel import ContextParallelRow, context_parallel_forward, localize
from trl_padfree.prefix_sharing import SharedPrefixAttention
from trl_padfree.sequence_parallel import SequenceParallelGroup

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8
# Segments of a 24-token row: one straddles the first boundaries, one is longer than a chunk of 4 or 6, the last is
# the padding segment
CU_SEQ_LENS = torch.tensor([0, 5, 7, 19, 22, 24], dtype=torch.int32)
ROW = int(CU_SEQ_LENS[-1])


class Layer(torch.nn.Module):
    is_causal = True


def row_tensors(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, HEADS, ROW, HEAD_DIM, generator=generator)
    key, value = (torch.randn(1, KV_HEADS, ROW, HEAD_DIM, generator=generator) for _ in range(2))
    return query, key, value


def attention_by_chunks(ranks: int, query, key, value, shared_prefix=None, module=None, **options) -> torch.Tensor:
    """Every rank's output, in rank order, with its gather returning the whole row's keys and values."""
    length = ROW // ranks
    outputs = []
    for rank in range(ranks):
        row = ContextParallelRow(SequenceParallelGroup(None, rank, ranks), ROW, CU_SEQ_LENS, shared_prefix)
        row.gather_keys_and_values = lambda chunk_key, chunk_value: (key, value)
        chunk = slice(rank * length, (rank + 1) * length)
        with context_parallel_forward(row):
            output, _ = padfree_varlen_attention(
                module or Layer(),
                query[:, :, chunk],
                key[:, :, chunk],
                value[:, :, chunk],
                None,
                cu_seq_lens_q=CU_SEQ_LENS,
                context_parallel=row,
                **options,
            )
        outputs.append(output)
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("ranks", [2, 3, 4, 6])
def test_chunks_attending_to_the_gathered_row_equal_the_whole_row(ranks):
    query, key, value = row_tensors()
    expected, _ = padfree_varlen_attention(Layer(), query, key, value, None, cu_seq_lens_q=CU_SEQ_LENS)
    torch.testing.assert_close(attention_by_chunks(ranks, query, key, value), expected, atol=1e-6, rtol=0)


def test_sliding_window_and_softcap_survive_the_split():
    query, key, value = row_tensors(1)
    options = {"sliding_window": 3, "softcap": 5.0}
    expected, _ = padfree_varlen_attention(Layer(), query, key, value, None, cu_seq_lens_q=CU_SEQ_LENS, **options)
    torch.testing.assert_close(attention_by_chunks(4, query, key, value, **options), expected, atol=1e-6, rtol=0)


def test_chunked_attention_layers_cut_the_row_before_it_is_split():
    class Config:
        attention_chunk_size = 4

    class ChunkedLayer(Layer):
        config = Config()

    query, key, value = row_tensors(2)
    expected, _ = padfree_varlen_attention(ChunkedLayer(), query, key, value, None, cu_seq_lens_q=CU_SEQ_LENS)
    chunks = attention_by_chunks(3, query, key, value, module=ChunkedLayer())
    torch.testing.assert_close(chunks, expected, atol=1e-6, rtol=0)


def test_a_rejected_branch_reads_its_prefix_from_another_rank():
    # Segment 0 (5 tokens) is prefix + chosen branch, segment 1 (2 tokens) the rejected branch reading the first 3;
    # segment 2 is prefix + chosen again, segment 3 a rejected branch reading 6 tokens of it, across chunks
    shared = SharedPrefixAttention.from_branches(
        branch_starts=torch.tensor([5, 19]),
        branch_lens=torch.tensor([2, 3]),
        prefix_starts=torch.tensor([0, 7]),
        prefix_lens=torch.tensor([3, 6]),
        cu_seq_lens=CU_SEQ_LENS,
    )
    query, key, value = row_tensors(3)
    expected, _ = padfree_varlen_attention(
        Layer(), query, key, value, None, cu_seq_lens_q=CU_SEQ_LENS, shared_prefix=shared
    )
    for ranks in (2, 4, 6):
        chunks = attention_by_chunks(ranks, query, key, value, shared_prefix=shared)
        torch.testing.assert_close(chunks, expected, atol=1e-6, rtol=0)


def test_localize_keeps_the_keys_up_to_the_chunks_last_query():
    positions = torch.arange(ROW)
    bounds = CU_SEQ_LENS.tolist()
    ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
    local = localize(positions, bounds, ranges, chunk=(8, 16), with_query_index=False)
    # Chunk 8..16 holds queries 8..16 of segment 2 (7..19): keys 7..16
    assert local.segments == (2,)
    assert local.cu_seq_lens_q.tolist() == [0, 8] and local.cu_seq_lens_k.tolist() == [0, 9]
    assert local.key_index.tolist() == list(range(7, 16))
    local = localize(positions, bounds, ranges, chunk=(16, 24), with_query_index=False)
    assert local.segments == (2, 3, 4)
    assert local.cu_seq_lens_q.tolist() == [0, 3, 6, 8] and local.cu_seq_lens_k.tolist() == [0, 12, 15, 17]


def test_attention_without_the_row_during_a_context_parallel_forward_is_an_error():
    row = ContextParallelRow(SequenceParallelGroup(None, 0, 2), ROW, CU_SEQ_LENS)
    query, key, value = row_tensors()
    with pytest.raises(ValueError, match="did not receive the context-parallel row"), context_parallel_forward(row):
        padfree_varlen_attention(Layer(), query, key, value, None, cu_seq_lens_q=CU_SEQ_LENS)


def test_a_forward_in_which_no_attention_read_the_row_is_an_error():
    row = ContextParallelRow(SequenceParallelGroup(None, 0, 2), ROW, CU_SEQ_LENS)
    with pytest.raises(ValueError, match="No attention layer of this model read the context-parallel row"):
        with context_parallel_forward(row):
            pass
