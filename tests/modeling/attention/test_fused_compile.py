"""The fused kernels under `torch.compile`, and FlexAttention's block mask on long rows (attention/fused.py,
integrations/torch.py):

    wide heads  ATen's memory-efficient kernel behind `trl_padfree::efficient_attention`, an op of our own with a fake
                implementation and autograd: compiled with `aot_eager` on meta tensors at head dim 512 (the kernel
                has no CPU implementation; compiling ATen's op itself fails in torch 2.13's meta function of its
                backward), and through the stand-ins on CPU with `aot_eager` (and inductor, `slow`), equal to eager
    softcap     FlexAttention compiled with dynamic shapes: a bounded number of graphs over 50 batches of random rows,
                both windows, training and no-grad, with prefix sharing; a variant past the recompile limit raises
                instead of running unfused. flash-attn is not installed here: its path compiles through the stand-in,
                which has the real signature (what that cannot show: flash-attn's own registered ops and their fake
                implementations, which only a GPU run with flash-attn traces)
    block mask  built from the row's host boundaries: the same tiles as FlexAttention's `create_block_mask`, which
                evaluates every query-key pair; peak memory of building it bounded at 32K tokens

FlexAttention refuses a backward on CPU (`_validate_device`); the graph-count test lifts that one refusal so that dynamo
traces the training graphs a GPU gets (same guards, another device), and runs them with `aot_eager`.
"""

from __future__ import annotations

import random
import tracemalloc
import warnings

import pytest
import torch
from fused_layers import LAYERS, LENGTHS
from stand_in_fused_kernels import (
    EFFICIENT_ATTENTION,
    dense_reference,
    efficient_attention_forward,
    fused_stand_ins,
    scaled_dot_product_attention,
    segment_mask,
)
from stand_in_kernels import CALLS, varlen_stand_in
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile

from trl_padfree.integrations.torch import compiled_flex_attention, efficient_attention_op
from trl_padfree.modeling.attention import fused
from trl_padfree.modeling.attention.interface import padfree_varlen_attention
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.packing.layout import cu_seq_lens_from_lengths


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    CALLS.clear()
    yield
    torch._dynamo.reset()
    CALLS.clear()


def random_row(rng: random.Random, longest: int, prefix_sharing: bool) -> tuple[list[int], list[int]]:
    """Query and key boundaries of a packed row; under prefix sharing each segment reads more keys than its queries
    (its shared prompt's)."""
    lengths_q = [rng.randint(1, longest) for _ in range(rng.randint(1, 4))]
    lengths_k = [length + (rng.randint(1, longest // 2) if prefix_sharing else 0) for length in lengths_q]
    bounds_q, bounds_k = [0], [0]
    for length_q, length_k in zip(lengths_q, lengths_k, strict=True):
        bounds_q.append(bounds_q[-1] + length_q)
        bounds_k.append(bounds_k[-1] + length_k)
    return bounds_q, bounds_k


# ---- the block mask from host boundaries ----


def allowed_pairs(bounds_q, bounds_k, window, causal) -> torch.Tensor:
    """The per-segment reference's mask (flash's bottom-right alignment, a window of `window` keys)."""
    return segment_mask(bounds_q, bounds_k, causal, left=-1 if window is None else window - 1)


def test_the_block_mask_has_flex_attentions_own_tiles_and_the_per_segment_mask():
    rng = random.Random(0)
    for trial in range(40):
        bounds_q, bounds_k = random_row(rng, 300, prefix_sharing=trial % 2 == 1)
        window, causal = rng.choice([None, 1, 7, 128, 200]), trial % 5 != 0
        mine = fused.document_block_mask(BlockMask.from_kv_blocks, bounds_q, bounds_k, window, causal, "cpu")
        dense = create_block_mask(mine.mask_mod, None, None, bounds_q[-1], bounds_k[-1], device="cpu")

        blocks_q, blocks_k = dense.kv_indices.shape[-2:]
        for name in ("kv_num_blocks", "full_kv_num_blocks"):  # the extra tiles (at least 2 each way) are empty
            assert torch.equal(getattr(mine, name)[..., :blocks_q], getattr(dense, name)), (trial, name)
            assert not getattr(mine, name)[..., blocks_q:].any(), (trial, name)
        for counts, name in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            for row, count in enumerate(getattr(dense, counts)[0, 0].tolist()):
                listed = getattr(mine, name)[0, 0, row, :count]
                assert torch.equal(listed, getattr(dense, name)[0, 0, row, :count]), (trial, name, row)
        assert mine.seq_lengths == (bounds_q[-1], bounds_k[-1]) and tuple(mine.shape[-2:]) == mine.seq_lengths
        pairs = torch.nn.attention.flex_attention.create_mask(mine.mask_mod, None, None, *mine.seq_lengths)
        assert torch.equal(pairs[0, 0], allowed_pairs(bounds_q, bounds_k, window, causal)), trial


def test_flex_attention_over_the_block_mask_is_the_per_segment_reference():
    # FlexAttention on CPU, no grad (its CPU backward is refused): eager here, inductor's CPU kernel under `slow`
    assert_flex_is_the_reference(flex_attention)


@pytest.mark.slow
def test_compiled_flex_attention_over_the_block_mask_is_the_per_segment_reference(fresh_dynamo):
    # Inductor's CPU kernel reads the tiles (skipping the unlisted, not calling the mask_mod on full ones)
    assert_flex_is_the_reference(torch.compile(flex_attention, dynamic=True))


def assert_flex_is_the_reference(attention) -> None:
    rng = random.Random(1)
    for trial in range(6):
        bounds_q, bounds_k = random_row(rng, 300, prefix_sharing=trial % 2 == 1)
        window, causal = (None, 64)[trial % 2], trial != 4
        generator = torch.Generator().manual_seed(trial)
        query = torch.randn(1, 4, bounds_q[-1], 16, generator=generator)
        key, value = (torch.randn(1, 2, bounds_k[-1], 16, generator=generator) for _ in "kv")
        mask = fused.document_block_mask(BlockMask.from_kv_blocks, bounds_q, bounds_k, window, causal, "cpu")
        score_mod = fused.softcap_score_mod(30.0, torch.device("cpu"))
        with torch.no_grad():
            output = fused.flex_softcap(query, key, value, mask, score_mod, attention, dict(scale=0.3))
        allowed = allowed_pairs(bounds_q, bounds_k, window, causal)
        expected = dense_reference(query[0], key[0], value[0], allowed, 0.3, softcap=30.0).transpose(0, 1)
        torch.testing.assert_close(output[0], expected, atol=2e-5, rtol=2e-5, msg=f"trial {trial}")


def peak_build_bytes(total: int) -> tuple[int, int]:
    """Peak bytes of building the block mask of a `total`-token row of four causal segments on CPU: torch's
    allocations (the profiler's memory events, summed in time order) and Python's (tracemalloc)."""
    quarter = total // 4
    bounds = [0, quarter - 7, 2 * quarter - 4, 3 * quarter - 3, total]
    return peak_bytes(lambda: fused.document_block_mask(BlockMask.from_kv_blocks, bounds, bounds, None, True, "cpu"))


def peak_bytes(build) -> tuple[int, int]:
    tracemalloc.start()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            build()
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    events = profiler.profiler.kineto_results.events()
    allocations = sorted((event.start_ns(), event.nbytes()) for event in events if event.name() == "[memory]")
    live = torch_peak = 0
    for _, size in allocations:
        live += size
        torch_peak = max(torch_peak, live)
    return torch_peak, python_peak


def test_building_the_block_mask_of_a_32k_row_takes_no_t_by_t_memory():
    # FlexAttention's create_block_mask takes about 10 bytes per query-key pair (160 MiB at 4K, 10 GiB at 32K);
    # the host tiles take about 4 MiB at 32K (docs/concepts/kernels.md)
    torch_peak, python_peak = peak_build_bytes(32 * 1024)
    assert torch_peak > 0  # the profiler saw the allocations
    assert torch_peak + python_peak < 64 * 2**20


# ---- FlexAttention: graphs bounded, never unfused ----


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    # Lift FlexAttention's one CPU refusal (no backward) so that dynamo traces the training graphs a GPU gets
    monkeypatch.setattr("torch.nn.attention.flex_attention._validate_device", lambda query, key, value: None)


def flex_graphs(attention, batches: int, longest: int) -> int:
    """Rows of random lengths through `attention` as training calls it: per batch, both windows of Gemma 2's
    alternating layers, a training forward and backward and a no-grad forward, every other row prefix-shared."""
    rng = random.Random(0)
    score_mod = fused.softcap_score_mod(50.0, torch.device("cpu"))
    for batch in range(batches):
        bounds_q, bounds_k = random_row(rng, longest, prefix_sharing=batch % 2 == 1)
        for training in (True, False):
            for window in (None, 16):
                mask = fused.document_block_mask(BlockMask.from_kv_blocks, bounds_q, bounds_k, window, True, "cpu")
                query = torch.randn(1, 4, bounds_q[-1], 16, requires_grad=training)
                key, value = (torch.randn(1, 2, bounds_k[-1], 16, requires_grad=training) for _ in "kv")
                with torch.set_grad_enabled(training):
                    output = fused.flex_softcap(query, key, value, mask, score_mod, attention, dict(scale=0.25))
                if training:
                    output.sum().backward()
    return counters["stats"]["unique_graphs"]


def assert_flex_graphs_bounded(batches: int, longest: int) -> None:
    with warnings.catch_warnings():
        # FlexAttention run unfused says so in a warning: here it fails the test (past the recompile limit, the
        # compiled function raises instead)
        warnings.filterwarnings("error", message=".*unfused implementation", category=UserWarning)
        graphs = flex_graphs(compiled_flex_attention(backend="aot_eager"), batches, longest)
    # Training and no-grad, each for rows with as many keys as queries and with more: windows, lengths and short
    # rows (a tile grid of at least 2 x 2) take no graph of their own
    assert 0 < graphs <= 4, graphs


def test_flex_attention_compiles_a_bounded_number_of_graphs(fresh_dynamo, flex_backward_on_cpu):
    assert_flex_graphs_bounded(batches=12, longest=160)


@pytest.mark.slow
def test_flex_attention_compiles_a_bounded_number_of_graphs_over_50_batches(fresh_dynamo, flex_backward_on_cpu):
    assert_flex_graphs_bounded(batches=50, longest=200)


@torch._dynamo.config.patch(recompile_limit=1)
def test_flex_attention_past_the_recompile_limit_raises_instead_of_running_unfused(fresh_dynamo):
    attention = compiled_flex_attention(backend="aot_eager")
    score_mod = fused.softcap_score_mod(50.0, torch.device("cpu"))

    def call(bounds_q, bounds_k):
        mask = fused.document_block_mask(BlockMask.from_kv_blocks, bounds_q, bounds_k, None, True, "cpu")
        query, key = torch.randn(1, 2, bounds_q[-1], 16), torch.randn(1, 2, bounds_k[-1], 16)
        with torch.no_grad():
            return fused.flex_softcap(query, key, key, mask, score_mod, attention, dict(scale=0.25))

    call([0, 30, 70], [0, 30, 70])
    with pytest.raises(RuntimeError, match="recompile_limit .* unfused.*flash-attn"):
        call([0, 30, 70], [0, 50, 110])  # more keys than queries: a second graph, past a limit of 1


# ---- wide heads: the memory-efficient kernel as an op of our own ----


def wide_head_inputs(device: str, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    return [
        torch.randn(1, total, 4, 512, generator=generator, dtype=dtype).to(device).requires_grad_() for _ in range(3)
    ]


def wide_heads(op, query, key, value, cu_seq_lens):
    options = dict(custom_mask_type=2, scale=512**-0.5)
    inputs = (tensor[0] for tensor in (query, key, value))
    return fused.efficient_wide_heads(*inputs, (cu_seq_lens, cu_seq_lens), (14, 14), op, options)


def test_the_wide_head_op_compiles_forward_and_backward_at_head_dim_512_on_meta_tensors(fresh_dynamo):
    # ATen's op itself fails here in torch 2.13: its backward's meta function lacks `out` and `window_size`
    query, key, value = wide_head_inputs("meta")
    cu_seq_lens = cu_seq_lens_from_lengths(LENGTHS).to("meta")
    compiled = torch.compile(wide_heads, backend="aot_eager", fullgraph=True)

    output = compiled(efficient_attention_op(), query, key, value, cu_seq_lens)
    output.sum().backward()

    assert output.shape == (sum(LENGTHS), 4, 512) and output.device.type == "meta"
    assert all(tensor.grad.shape == tensor.shape for tensor in (query, key, value))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_wide_head_op_computes_autograd_through_atens_forward_exactly_compiled_or_not(fresh_dynamo, backend):
    # Through the stand-ins of ATen's forward and backward (tests/support/stand_in_fused_kernels.py): the op's gradients
    # equal autograd's through the forward alone, as ATen's own derivative calls its backward
    cu_seq_lens = cu_seq_lens_from_lengths(LENGTHS)
    inputs = wide_head_inputs("cpu")
    weights = torch.randn(sum(LENGTHS), 4, 512, generator=torch.Generator().manual_seed(1))

    def autograd_through_forward(query, key, value, cu_q, cu_k, max_q, max_k, mask, scale, log_sumexp):
        return efficient_attention_forward(query, key, value, None, cu_q, cu_k, max_q, max_k, 0.0, mask, scale=scale)[
            :2
        ]

    results = {}
    for name, op in {"forward alone": autograd_through_forward, "op": EFFICIENT_ATTENTION}.items():
        call = torch.compile(wide_heads, backend=backend) if name == "op" else wide_heads
        output = call(op, *inputs, cu_seq_lens)
        results[name] = (output, *torch.autograd.grad((output.float() * weights).sum(), inputs))
    for name, expected, got in zip(("output", "query", "key", "value"), *results.values(), strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0, msg=name)


# ---- each fused path through the compiled attention function, on the stand-ins ----


@pytest.mark.parametrize("layer", ["softcap_flash_attn", "softcap_flex", "wide_heads"])
def test_each_fused_path_compiles_through_the_stand_ins_to_its_eager_result(fresh_dynamo, layer):
    # The stand-ins read host integers and record calls (graph breaks); what compiles is trl-padfree's code around
    # them: the plan, casts, the key expansion, the block mask and the op of the wide heads
    head_dim, heads, kv_heads, options, flash_attn, kernel = LAYERS[layer]
    generator = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(1, count, sum(LENGTHS), head_dim, generator=generator, requires_grad=True)
        for count in (heads, kv_heads, kv_heads)
    ]
    call = dict(scaling=head_dim**-0.5, cu_seq_lens_q=cu_seq_lens_from_lengths(LENGTHS), max_length_q=max(LENGTHS))

    def attention(query, key, value):
        return padfree_varlen_attention(torch.nn.Module(), query, key, value, None, **call, **options)[0]

    stand_ins = dict(
        varlen=varlen_stand_in("2.15"), fused=fused_stand_ins(flash_attn), sdpa=scaled_dot_product_attention
    )
    results = []
    for function in (attention, torch.compile(attention, backend="aot_eager")):
        with stand_in_kernels(**stand_ins), torch.autocast("cpu", dtype=torch.bfloat16):
            output = function(*inputs)
        results.append((output, *torch.autograd.grad(output.float().sum(), inputs)))

    assert counters["stats"]["unique_graphs"] > 0
    assert {call.kernel for call in CALLS} >= {kernel}
    for name, eager, compiled in zip(("output", "query", "key", "value"), *results, strict=True):
        torch.testing.assert_close(compiled, eager, atol=0, rtol=0, msg=name)
