"""Context parallelism (all-gather-KV attention over packed rows): the attention of every rank's chunk, put back
together, equals `padfree_varlen` on the whole row; here in one process, each rank's gather handed the whole row's
keys and values. The multi-process runs over gloo are further down."""

import pytest
import torch
from tolerances import ATTENTION_ATOL, DISTRIBUTED_LOSS_ATOL, DISTRIBUTED_METRIC_ATOL, DISTRIBUTED_METRIC_RTOL

from trl_padfree.modeling.attention.gathered import GatheredKeys
from trl_padfree.modeling.attention.interface import padfree_varlen_attention
from trl_padfree.modeling.attention.rows import PackedRow, row_in_flight
from trl_padfree.packing.layout import HostRow
from trl_padfree.packing.prefix_sharing import shared_prefix_keys
from trl_padfree.parallel.context import ContextParallelRow, localize
from trl_padfree.parallel.groups import RowGroup

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
        row = ContextParallelRow(
            CU_SEQ_LENS, None, group=RowGroup(None, rank, ranks), row_length=ROW, shared_prefix=shared_prefix
        )
        row.gather_keys_and_values = lambda chunk_key, chunk_value: (key, value)
        chunk = slice(rank * length, (rank + 1) * length)
        with row_in_flight(row):
            output, _ = padfree_varlen_attention(
                module or Layer(),
                query[:, :, chunk],
                key[:, :, chunk],
                value[:, :, chunk],
                None,
                packed_row=row,
                **options,
            )
        outputs.append(output)
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("ranks", [2, 3, 4, 6])
def test_chunks_attending_to_the_gathered_row_equal_the_whole_row(ranks):
    query, key, value = row_tensors()
    expected, _ = padfree_varlen_attention(Layer(), query, key, value, None, cu_seq_lens_q=CU_SEQ_LENS)
    torch.testing.assert_close(attention_by_chunks(ranks, query, key, value), expected, atol=ATTENTION_ATOL, rtol=0)


def test_sliding_window_and_softcap_survive_the_split():
    query, key, value = row_tensors(1)
    options = {"sliding_window": 3, "softcap": 5.0}
    expected, _ = padfree_varlen_attention(Layer(), query, key, value, None, cu_seq_lens_q=CU_SEQ_LENS, **options)
    torch.testing.assert_close(
        attention_by_chunks(4, query, key, value, **options), expected, atol=ATTENTION_ATOL, rtol=0
    )


def test_chunked_attention_layers_cut_the_row_before_it_is_split():
    class Config:
        attention_chunk_size = 4

    class ChunkedLayer(Layer):
        config = Config()

    query, key, value = row_tensors(2)
    expected, _ = padfree_varlen_attention(ChunkedLayer(), query, key, value, None, cu_seq_lens_q=CU_SEQ_LENS)
    chunks = attention_by_chunks(3, query, key, value, module=ChunkedLayer())
    torch.testing.assert_close(chunks, expected, atol=ATTENTION_ATOL, rtol=0)


def test_a_rejected_branch_reads_its_prefix_from_another_rank():
    # Segment 0 (5 tokens) is prefix + chosen branch, segment 1 (2 tokens) the rejected branch reading the first 3;
    # segment 2 is prefix + chosen again, segment 3 a rejected branch reading 6 tokens of it, across chunks
    bounds = tuple(CU_SEQ_LENS.tolist())
    starts = bounds[:-1]
    prefix_starts, prefix_lens = [0] * len(starts), [0] * len(starts)
    prefix_starts[starts.index(5)], prefix_lens[starts.index(5)] = 0, 3
    prefix_starts[starts.index(19)], prefix_lens[starts.index(19)] = 7, 6
    lengths = tuple(end - start for start, end in zip(bounds, bounds[1:], strict=False))
    host = HostRow(bounds, lengths, starts, tuple(prefix_starts), tuple(prefix_lens))
    shared = shared_prefix_keys(host)
    query, key, value = row_tensors(3)
    expected, _ = padfree_varlen_attention(
        Layer(), query, key, value, None, packed_row=PackedRow.of_host_row(host, CU_SEQ_LENS, None)
    )
    for ranks in (2, 4, 6):
        chunks = attention_by_chunks(ranks, query, key, value, shared_prefix=shared)
        torch.testing.assert_close(chunks, expected, atol=ATTENTION_ATOL, rtol=0)


def test_localize_keeps_the_keys_up_to_the_chunks_last_query():
    bounds = CU_SEQ_LENS.tolist()
    pieces = [(range(start, end), (range(start, end),)) for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    segments = localize(pieces, chunk=(8, 16))
    local = GatheredKeys.of_pieces(segments.values(), torch.device("cpu"))
    # Chunk 8..16 holds queries 8..16 of segment 2 (7..19): keys 7..16
    assert tuple(segments) == (2,)
    assert local.cu_seq_lens_q.tolist() == [0, 8] and local.cu_seq_lens_k.tolist() == [0, 9]
    assert local.key_index.tolist() == list(range(7, 16))
    segments = localize(pieces, chunk=(16, 24))
    local = GatheredKeys.of_pieces(segments.values(), torch.device("cpu"))
    assert tuple(segments) == (2, 3, 4)
    assert local.cu_seq_lens_q.tolist() == [0, 3, 6, 8] and local.cu_seq_lens_k.tolist() == [0, 12, 15, 17]


def test_attention_without_the_row_during_a_context_parallel_forward_is_an_error():
    row = ContextParallelRow(CU_SEQ_LENS, None, group=RowGroup(None, 0, 2), row_length=ROW)
    query, key, value = row_tensors()
    with pytest.raises(ValueError, match="did not receive the context-parallel row"), row_in_flight(row):
        padfree_varlen_attention(Layer(), query, key, value, None, cu_seq_lens_q=CU_SEQ_LENS)


def test_a_forward_in_which_no_attention_read_the_row_is_an_error():
    row = ContextParallelRow(CU_SEQ_LENS, None, group=RowGroup(None, 0, 2), row_length=ROW)
    with pytest.raises(ValueError, match="No attention layer of this model read the context-parallel row"):
        with row_in_flight(row):
            pass


# ---------------------------------------------------------------------------------------------------------------------
# For real: CPU processes over gloo, a model with 6 attention heads (Ulysses could split it over 2, 3 or 6 ranks, not
# over 4), every step equal to one process on the same micro-batches

PAIRS = 2  # per micro-batch: every rank of a group shares it
STEPS = 4


@pytest.fixture(scope="module")
def single_process(six_head_model, tmp_path_factory):
    from distributed_runs import train_in_this_process

    output = tmp_path_factory.mktemp("single") / "report.json"
    options = ("--runs", "trl+eval", "--batch-size", str(PAIRS), "--steps", str(STEPS))
    return train_in_this_process(six_head_model, output, *options)["trl+eval"]


def launch_context_parallel(model, tmp_path, config: str, runs: str, processes: int, *options: str) -> dict:
    from distributed_runs import launch

    arguments = ("--runs", runs, "--batch-size", str(PAIRS), "--steps", str(STEPS), "--cp-size", str(processes))
    return launch(config, model, tmp_path / "report.json", *arguments, *options, processes=processes)


def assert_no_object_collective(report: dict) -> None:
    from distributed_runs import assert_no_object_collective

    assert_no_object_collective(report)


def assert_same_split_training(report: dict, expected: dict, ranks_per_row: int) -> None:
    from distributed_runs import assert_split_row_training

    assert report["world_size"] == ranks_per_row
    assert report["context_parallel_size"] * report["sequence_parallel_size"] == ranks_per_row
    assert_split_row_training(report, expected)


@pytest.mark.parametrize("processes", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes on 2 cores: slow
def test_context_parallel_group_equals_one_process_with_prefix_sharing_too(
    six_head_model, single_process, tmp_path, processes
):
    runs = ("padding_free+cp+eval", "padding_free+cp+prefix_sharing", "padding_free+cp+precompute")
    reports = launch_context_parallel(
        six_head_model, tmp_path, "multi_gpu.yaml", ",".join(runs), processes, "--count-collectives"
    )
    for run in runs:
        assert_same_split_training(reports[run], single_process, processes)
        assert_no_object_collective(reports[run])
    # Evaluation is not split: each rank evaluates whole rows of its own batches, data-parallel
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/chosen"):
        expected = single_process["eval"][key]
        assert reports["padding_free+cp+eval"]["eval"][key] == pytest.approx(
            expected, rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL
        ), key
    if processes == 4:
        assert reports["padding_free+cp+eval"]["longest_sequence_over_chunk"] > 1, "no sequence spanned three chunks"
    assert all(
        metrics["padfree/shared_tokens"] > 0 for metrics in reports["padding_free+cp+prefix_sharing"]["metrics"]
    )


@pytest.mark.parametrize(
    "config, run",
    # FSDP2 with context parallelism runs by default on image rows (tests/integration/vision/test_vision_split_rows.py)
    [
        ("zero3.yaml", "padding_free+cp+ref_offload"),
        pytest.param("fsdp2.yaml", "padding_free+cp+ref_offload", marks=pytest.mark.slow),
    ],
    ids=["zero3", "fsdp2"],
)
def test_context_parallel_under_a_sharding_engine_with_the_reference_offloaded(
    six_head_model, single_process, tmp_path, config, run
):
    if config.startswith("zero3"):
        pytest.importorskip("deepspeed")
    report = launch_context_parallel(six_head_model, tmp_path, config, run, 2)[run]
    assert report["policy_sharded"] or report["policy_fsdp"]["sharded"], "the engine did not shard the policy"
    assert report["reference"]["offloaded"] or report["reference_fsdp"]["cpu_offload"]
    assert_same_split_training(report, single_process, 2)


def test_context_parallel_with_token_budget_batches_equals_padded_trl_on_the_same_pairs(six_head_model, tmp_path):
    from distributed_runs import launch, train_in_this_process

    options = ("--max-tokens-per-batch", "1024", "--steps", "2", "--max-length", "512", "--cp-size", "2")
    report = launch("multi_gpu.yaml", six_head_model, tmp_path / "budget.json", "--runs", "padding_free+cp", *options)
    report = report["padding_free+cp"]
    assert report["context_parallel_size"] == 2 and report["sequences_split_across_ranks"] > 0
    # A group runs its ranks' micro-batches one after the other: step 1 is rank 0's first micro-batch
    pairs = report["micro_batches"][0]
    padded_options = ("--pairs", ",".join(map(str, pairs)), "--batch-size", str(len(pairs)), "--steps", "1")
    padded = train_in_this_process(
        six_head_model, tmp_path / "padded.json", "--runs", "trl", *padded_options, "--max-length", "512"
    )["trl"]
    assert report["losses"][0] == pytest.approx(padded["losses"][0], abs=DISTRIBUTED_LOSS_ATOL)
    for key in ("rewards/chosen", "logps/chosen", "logps/rejected", "grad_norm"):
        assert report["metrics"][0][key] == pytest.approx(
            padded["metrics"][0][key], rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL
        )


def test_ulysses_and_context_parallelism_together_equal_one_process(six_head_model, single_process, tmp_path):
    # 4 ranks share each row: Ulysses splits the 6 heads over pairs of ranks, context parallelism the rest
    pytest.importorskip("deepspeed")
    from distributed_runs import launch

    options = ("--batch-size", str(PAIRS), "--steps", str(STEPS), "--sp-size", "2", "--cp-size", "2")
    report = launch("zero3.yaml", six_head_model, tmp_path / "report.json", "--runs", "padding_free+cp+sp", *options,
                    processes=4)["padding_free+cp+sp"]  # fmt: skip
    assert report["sequence_parallel_size"] == 2 and report["policy_sharded"]
    assert_same_split_training(report, single_process, ranks_per_row=4)


# ---------------------------------------------------------------------------------------------------------------------
# Refusals


def test_context_parallelism_needs_padding_free(tmp_path):
    from trl_padfree import DPOConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    with pytest.raises(ValueError, match="context_parallel_size=2 needs padding_free=True"):
        DPOConfig(context_parallel_size=2, **common)
    with pytest.raises(ValueError, match="context_parallel_size must be at least 1"):
        DPOConfig(context_parallel_size=0, padding_free=True, **common)


def test_a_group_larger_than_the_processes_is_refused_by_the_trainer(tmp_path):
    from trainer_utils import make_trainer

    with pytest.raises(
        ValueError, match="context_parallel_size x sequence_parallel_size = 2 must divide the number of processes, 1"
    ):
        make_trainer(padding_free=True, output_dir=str(tmp_path), context_parallel_size=2)


def test_other_attention_and_moe_auxiliary_loss_are_refused():
    from trl_padfree.refusals.parallel import check_context_parallel_attention, check_split_rows_without_moe_aux_loss

    with pytest.raises(ValueError, match="runs in the `padfree_varlen` attention.*this model runs 'sdpa'"):
        check_context_parallel_attention("sdpa")
    with pytest.raises(ValueError, match="Mixture-of-Experts auxiliary loss"):
        check_split_rows_without_moe_aux_loss("Context parallelism", "context_parallel_size=1", aux_loss_enabled=True)
    check_context_parallel_attention("padfree_varlen")
    check_split_rows_without_moe_aux_loss("Context parallelism", "context_parallel_size=1", aux_loss_enabled=False)
