"""The `padfree_varlen` attention function: against naive dense attention of the whole row (forward and gradients),
and through tiny models against their own eager attention run on each sequence alone, for what sdpa cannot do:
chunked attention (llama4), logit softcapping (gemma2) and attention sinks (gpt_oss). Then which call of torch's CUDA
varlen kernel each torch signature gets, decided on CPU; the CUDA runs themselves are marked `gpu`.

The attention row (`ATTENTION_LENGTHS` of tests/modeling/test_models.py), cut into chunks of 4 for a chunked layer:

    offset in sequence | 0 1 2 3 4 | 0 | 0 1 2 3 4 5 6 7 8 |
    cu_seq_lens        0           5   6                   15
    chunked            0       4   5   6       10      14  15

The model row is tests/modeling/test_models.py's: sequences of 10, 3, 15, 8, 11 and 6 tokens, all but one longer than the
chunk (4) and four longer than the sliding window (6).
"""

import logging
import math

import pytest
import torch
from packed_rows import (
    ATTENTION_LENGTHS,
    EXAMPLES,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    PACKED_KEYS,
    block_diagonal_attention,
    max_error,
    packed_log_probs,
    per_sequence_log_probs,
    random_qkv,
)
from tiny_fixtures import make_model
from tolerances import (
    ATTENTION_ATOL,
    ATTENTION_GRAD_RTOL,
    BF16_ATTENTION_ATOL,
    BF16_ATTENTION_RTOL,
    LOG_PROB_ATOL,
)

from trl_padfree.modeling.attention import rows
from trl_padfree.modeling.attention import varlen as attention
from trl_padfree.modeling.attention.interface import attention_chunk_size, padfree_varlen_attention
from trl_padfree.modeling.attention.plan import KernelTarget, LayerCall, varlen_kernel_plan
from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION
from trl_padfree.modeling.kernels.attention import FlexKernel, FusedKernels, varlen_kernel
from trl_padfree.modeling.packed_forward import PackedBatch, add_packed_forward
from trl_padfree.packing.collator import concatenated_inputs
from trl_padfree.packing.layout import (
    chunked_cu_seq_lens,
    cu_seq_lens_from_lengths,
    position_ids_from_lengths,
    segment_ids_from_lengths,
)

SCALING = HEAD_DIM**-0.5
CHUNK_SIZE = 4
SOFTCAP = 1.0  # bends the logits of unit-variance random queries and keys, and of `make_gemma2`


def call_padfree_varlen(query, key, value, attention_mask=None, module=None, **kwargs):
    return padfree_varlen_attention(
        module or torch.nn.Module(), query, key, value, attention_mask, scaling=SCALING, **kwargs
    )


def with_cu_seq_lens(lengths):
    cu_seq_lens = cu_seq_lens_from_lengths(lengths)
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": max(lengths)}


class Config:
    """Stands in for a model config: only the attributes the attention reads."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def attention_module(config=None, layer_idx=None):
    module = torch.nn.Module()
    if config is not None:
        module.config = config
    if layer_idx is not None:
        module.layer_idx = layer_idx
    return module


def chunked_layer(chunk_size=CHUNK_SIZE):
    return attention_module(Config(layer_types=["chunked_attention"], attention_chunk_size=chunk_size), layer_idx=0)


def random_sinks(seed=1):
    return torch.randn(NUM_HEADS, generator=torch.Generator().manual_seed(seed))


def allowed_keys(lengths, sliding_window=None, chunk_size=None):
    """`(T, T)`: which keys each query of the packed row may see, from segment ids and in-sequence offsets."""
    segment_ids = segment_ids_from_lengths(torch.tensor(lengths))
    offsets = position_ids_from_lengths(lengths)[0]
    same_sequence = segment_ids.unsqueeze(1) == segment_ids.unsqueeze(0)
    query_offsets, key_offsets = offsets.unsqueeze(1), offsets.unsqueeze(0)
    allowed = same_sequence & (key_offsets <= query_offsets)
    if sliding_window is not None:
        allowed &= key_offsets > query_offsets - sliding_window
    if chunk_size is not None:
        allowed &= key_offsets // chunk_size == query_offsets // chunk_size
    return allowed


def naive_attention(query, key, value, allowed, softcap=None, sinks=None):
    """Dense float64 attention of the whole row: `(1, T, heads, dim)`. A sink adds `exp(sink)` to each softmax
    denominator and nothing to its numerator."""
    query, key, value = (tensor.double() for tensor in (query, key, value))
    key = key.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    value = value.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    scores = (query @ key.transpose(-1, -2)) * SCALING
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    largest = scores.amax(-1, keepdim=True)
    if sinks is not None:
        largest = torch.maximum(largest, sinks.double().reshape(1, -1, 1, 1))
    numerators = (scores - largest).exp()
    denominators = numerators.sum(-1, keepdim=True)
    if sinks is not None:
        denominators = denominators + (sinks.double().reshape(1, -1, 1, 1) - largest).exp()
    return (numerators / denominators @ value).transpose(1, 2)


# ---- the function itself: boundaries, refusals ----


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


def test_padfree_varlen_refuses_non_causal_attention():
    query, key, value = random_qkv()
    encoder_attention = torch.nn.Module()
    encoder_attention.is_causal = False

    with pytest.raises(ValueError, match="only supports causal"):
        padfree_varlen_attention(encoder_attention, query, key, value, None, **with_cu_seq_lens(ATTENTION_LENGTHS))


def test_padfree_varlen_refuses_sinks_that_are_not_one_per_head():
    # e.g. sequence parallelism splitting heads over ranks while every rank holds all the sinks
    query, key, value = random_qkv()

    with pytest.raises(ValueError, match="one attention sink per query head: got 2 sinks for 4 heads"):
        call_padfree_varlen(query, key, value, s_aux=torch.zeros(2), **with_cu_seq_lens(ATTENTION_LENGTHS))


# ---- chunked attention ----


@pytest.mark.parametrize(
    "lengths, chunk_size, expected",
    [
        pytest.param([5, 1, 9], 4, [0, 4, 5, 6, 10, 14, 15], id="the-picture"),
        pytest.param([5, 1, 9], 9, [0, 5, 6, 15], id="no-sequence-longer-than-a-chunk"),
        pytest.param([3, 1], 1, [0, 1, 2, 3, 4], id="one-token-chunks"),
        pytest.param([4, 0, 8], 4, [0, 4, 8, 12], id="exact-multiples-and-an-empty-segment"),
    ],
)
def test_chunked_cu_seq_lens(lengths, chunk_size, expected):
    chunked = chunked_cu_seq_lens(cu_seq_lens_from_lengths(lengths), chunk_size)

    assert chunked.tolist() == expected
    assert chunked.dtype == torch.int32


def test_attention_chunk_size_reads_llama4_layer_types():
    model = make_llama4()
    assert model.config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]

    chunk_sizes = [attention_chunk_size(layer.self_attn) for layer in model.model.layers]

    assert chunk_sizes == [CHUNK_SIZE] * 3 + [None]


@pytest.mark.parametrize(
    "make_module, expected",
    [
        pytest.param(attention_module, None, id="no-config"),
        pytest.param(lambda: make_model("llama").model.layers[0].self_attn, None, id="llama"),
        pytest.param(lambda: make_model("gemma3_text").model.layers[0].self_attn, None, id="sliding-layer-types"),
        # transformers builds the chunked mask for every layer of a config with a chunk size and no layer types
        pytest.param(lambda: attention_module(Config(attention_chunk_size=8)), 8, id="chunk-size-no-layer-types"),
    ],
)
def test_attention_chunk_size_of_unchunked_and_all_chunked_configs(make_module, expected):
    assert attention_chunk_size(make_module()) == expected


def test_attention_chunk_size_refuses_a_layer_it_cannot_place():
    config = Config(layer_types=["chunked_attention", "full_attention"], attention_chunk_size=4)

    with pytest.raises(ValueError, match="no `layer_idx`"):
        attention_chunk_size(attention_module(config))
    with pytest.raises(ValueError, match="sets no attention_chunk_size"):
        attention_chunk_size(attention_module(Config(layer_types=["chunked_attention"]), layer_idx=0))


@pytest.mark.parametrize("sliding_window", [None, 3], ids=["causal", "window-3"])
@pytest.mark.parametrize("chunk_size", [1, 2, CHUNK_SIZE, 20])
def test_chunked_layer_equals_naive_chunked_attention(chunk_size, sliding_window):
    query, key, value = random_qkv()

    output, _ = call_padfree_varlen(
        query,
        key,
        value,
        module=chunked_layer(chunk_size),
        sliding_window=sliding_window,
        **with_cu_seq_lens(ATTENTION_LENGTHS),
    )

    allowed = allowed_keys(ATTENTION_LENGTHS, sliding_window, chunk_size)
    torch.testing.assert_close(
        output, naive_attention(query, key, value, allowed).float(), atol=ATTENTION_ATOL, rtol=0
    )


def test_chunked_layer_reads_chunks_from_position_ids_too():
    query, key, value = random_qkv()
    position_ids = position_ids_from_lengths(ATTENTION_LENGTHS)

    output, _ = call_padfree_varlen(query, key, value, module=chunked_layer(), position_ids=position_ids)

    allowed = allowed_keys(ATTENTION_LENGTHS, chunk_size=CHUNK_SIZE)
    torch.testing.assert_close(
        output, naive_attention(query, key, value, allowed).float(), atol=ATTENTION_ATOL, rtol=0
    )


SHARING_EXAMPLES = [
    {"prompt_ids": [5, 9, 13, 17, 21], "chosen_ids": [33, 37, 41], "rejected_ids": [45]},
    {"prompt_ids": [6, 10, 14], "chosen_ids": [18], "rejected_ids": [22, 26, 30, 34, 38, 42]},
]


def shared_row():
    batch = concatenated_inputs(SHARING_EXAMPLES, prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)
    packed = PackedBatch.from_collated(batch)
    assert packed.host.shared_pairs > 0
    return packed


def test_chunked_layer_refuses_a_prefix_sharing_row():
    packed = shared_row()
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, NUM_HEADS, packed.row_length, HEAD_DIM)] + [(1, NUM_KV_HEADS, packed.row_length, HEAD_DIM)] * 2
    query, key, value = (torch.randn(shape, generator=generator) for shape in shapes)

    with pytest.raises(ValueError, match="prefix sharing with chunked attention layers is not supported"):
        call_padfree_varlen(
            query,
            key,
            value,
            module=chunked_layer(),
            packed_row=packed.row(),
        )


# ---- softcapping and sinks ----


@pytest.mark.parametrize("sliding_window", [None, 3], ids=["causal", "window-3"])
@pytest.mark.parametrize(
    "softcap, with_sinks", [(SOFTCAP, False), (None, True), (SOFTCAP, True)], ids=["softcap", "sinks", "both"]
)
def test_softcap_and_sinks_equal_naive_attention(softcap, with_sinks, sliding_window):
    query, key, value = random_qkv()
    sinks = random_sinks() if with_sinks else None

    output, _ = call_padfree_varlen(
        query,
        key,
        value,
        sliding_window=sliding_window,
        softcap=softcap,
        s_aux=sinks,
        **with_cu_seq_lens(ATTENTION_LENGTHS),
    )

    allowed = allowed_keys(ATTENTION_LENGTHS, sliding_window)
    expected = naive_attention(query, key, value, allowed, softcap, sinks)
    torch.testing.assert_close(output, expected.float(), atol=ATTENTION_ATOL, rtol=0)
    # Against the plain attention the features are far beyond the tolerance, so the comparison above tests them
    assert max_error(output, naive_attention(query, key, value, allowed)) > 100 * ATTENTION_ATOL


@pytest.mark.parametrize(
    "softcap, chunk_size",
    [(SOFTCAP, None), (None, CHUNK_SIZE), (SOFTCAP, CHUNK_SIZE)],
    ids=["softcap", "chunked", "both"],
)
def test_gradients_equal_naive_attention(softcap, chunk_size):
    query, key, value = (tensor.requires_grad_() for tensor in random_qkv())
    sinks = random_sinks().requires_grad_()
    module = chunked_layer(chunk_size) if chunk_size else None
    inputs = (query, key, value, sinks)
    output_grad = torch.randn(
        1, sum(ATTENTION_LENGTHS), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2)
    )

    output, _ = call_padfree_varlen(
        query, key, value, module=module, softcap=softcap, s_aux=sinks, **with_cu_seq_lens(ATTENTION_LENGTHS)
    )
    grads = torch.autograd.grad(output, inputs, output_grad)

    allowed = allowed_keys(ATTENTION_LENGTHS, chunk_size=chunk_size)
    expected = naive_attention(query, key, value, allowed, softcap, sinks)
    expected_grads = torch.autograd.grad(expected, inputs, output_grad.double())
    for name, grad, expected_grad in zip(("query", "key", "value", "sinks"), grads, expected_grads, strict=True):
        assert expected_grad.abs().max() > 1e-2, name  # each input really receives a gradient
        torch.testing.assert_close(grad, expected_grad.float(), atol=ATTENTION_ATOL, rtol=0, msg=name)


# ---- through tiny models: packed padfree_varlen against eager on each sequence alone ----

TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8
)


def make_llama4(attn_implementation=ATTN_IMPLEMENTATION, attention_chunk_size=CHUNK_SIZE):
    # Layers 0-2 chunked with rope, layer 3 full attention without (llama4's interleaving); every layer MoE. The
    # NoPE layer's temperature tuning scales queries by row index, not position: a no-op under 8192 tokens
    return make_model(
        "llama4_text",
        attn_implementation=attn_implementation,
        **{**TINY, "num_hidden_layers": 4, "intermediate_size_mlp": 64, "num_local_experts": 2},
        attention_chunk_size=attention_chunk_size,
    )


def make_gemma2(attn_implementation=ATTN_IMPLEMENTATION, attn_logit_softcapping=SOFTCAP):
    # A sliding-window layer (6) then a full one; scaling query_pre_attn_scalar**-0.5 = 1/16, not 1/sqrt(head_dim)
    model = make_model(
        "gemma2",
        attn_implementation=attn_implementation,
        **TINY,
        sliding_window=6,
        attn_logit_softcapping=attn_logit_softcapping,
    )
    # Freshly initialised logits are ~1e-3, which no softcap bends: make them ~1
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


def make_gpt_oss(attn_implementation=ATTN_IMPLEMENTATION, sinks=True):
    # A sliding-window layer (6) then a full one. Sinks initialise to zero: give them values that matter
    model = make_model(
        "gpt_oss",
        attn_implementation=attn_implementation,
        **TINY,
        sliding_window=6,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(2 * torch.randn(NUM_HEADS, generator=generator) if sinks else 0.0)
    return model


MODELS = {"llama4_text": make_llama4, "gemma2": make_gemma2, "gpt_oss": make_gpt_oss}


@pytest.fixture(scope="module")
def packed_batch():
    batch = concatenated_inputs(EXAMPLES, pad_to_multiple_of=8)
    assert batch["seq_lens"].tolist() == [10, 3, 15, 8, 11, 6]
    return batch


@pytest.mark.parametrize("model_type", list(MODELS))
def test_packed_forward_equals_eager_per_sequence_forward(model_type, packed_batch):
    make = MODELS[model_type]

    packed = packed_log_probs(make().eval(), packed_batch)

    reference = per_sequence_log_probs(make(attn_implementation="eager").eval(), packed_batch)
    assert max_error(packed, reference) <= LOG_PROB_ATOL


@pytest.mark.parametrize(
    "model_type, without_the_feature",
    [
        pytest.param("llama4_text", dict(attention_chunk_size=8192), id="llama4-chunks"),
        pytest.param("gemma2", dict(attn_logit_softcapping=None), id="gemma2-softcap"),
        pytest.param("gpt_oss", dict(sinks=False), id="gpt_oss-sinks"),
    ],
)
def test_the_feature_is_in_effect(model_type, without_the_feature, packed_batch):
    # Otherwise the equality above would hold for an attention that ignored it
    make = MODELS[model_type]
    with_it = per_sequence_log_probs(make(attn_implementation="eager").eval(), packed_batch)
    without_it = per_sequence_log_probs(make(attn_implementation="eager", **without_the_feature).eval(), packed_batch)

    assert max_error(with_it, without_it) > 1e-2


def attention_gradients(model, batch, packed):
    """Gradients of the attention parameters of a fixed random mix of the real tokens' log-probs: from one packed
    forward, or from one forward per sequence."""
    num_real_tokens = int(batch["seq_lens"].sum())
    if packed:
        logits = model(**{key: batch[key] for key in PACKED_KEYS}, use_cache=False).logits[0, :num_real_tokens]
    else:
        sequences = batch["input_ids"][0, :num_real_tokens].split(batch["seq_lens"].tolist())
        logits = torch.cat([model(input_ids=ids.unsqueeze(0), use_cache=False).logits[0] for ids in sequences])
    weights = torch.rand(logits.shape, generator=torch.Generator().manual_seed(0))
    (logits.log_softmax(-1) * weights).sum().backward()
    return {name: parameter.grad for name, parameter in model.named_parameters() if "self_attn" in name}


@pytest.mark.parametrize("model_type", list(MODELS))
def test_packed_gradients_equal_eager_per_sequence_gradients(model_type, packed_batch):
    make = MODELS[model_type]

    packed = attention_gradients(make().eval(), packed_batch, packed=True)

    reference = attention_gradients(make(attn_implementation="eager").eval(), packed_batch, packed=False)
    assert model_type != "gpt_oss" or any(name.endswith("sinks") for name in packed)
    for name, grad in packed.items():
        # Entries reach ~50 (sums over every token): compare against the parameter's largest entry
        assert max_error(grad, reference[name]) <= ATTENTION_GRAD_RTOL * reference[name].abs().max().item(), name


def test_llama4_refuses_a_prefix_sharing_row():
    packed = shared_row()

    with pytest.raises(ValueError, match="prefix sharing with chunked attention layers is not supported"):
        make_llama4()(**packed.model_kwargs())


# ---- torch's CUDA varlen kernel: which call each torch signature gets ----

POSITIONAL = {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"}
TORCH_SIGNATURES = {
    "2.10": POSITIONAL | {"is_causal", "return_aux"},
    "2.11": POSITIONAL | {"return_aux", "scale", "window_size"},
    "2.12": POSITIONAL | {"return_aux", "scale", "window_size", "enable_gqa"},
}
PLAIN_LAYER = dict(dtype=torch.bfloat16, heads=NUM_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scaling=SCALING)


def layer_call(**changes) -> LayerCall:
    """`PLAIN_LAYER` with `changes`; its inputs in the dtype it computes in and its value as wide as its query unless
    `changes` say otherwise."""
    layer = {**PLAIN_LAYER, **changes}
    return LayerCall(**{"input_dtypes": (layer["dtype"],) * 3, "value_head_dim": layer["head_dim"], **layer})


@pytest.mark.parametrize(
    "torch_version, options",
    [
        ("2.10", {"is_causal": True}),
        ("2.11", {"window_size": (-1, 0), "scale": SCALING}),
        ("2.12", {"window_size": (-1, 0), "scale": SCALING, "enable_gqa": True}),
    ],
)
def test_kernel_plan_of_a_plain_grouped_layer(torch_version, options):
    plan = varlen_kernel_plan(layer_call(), KernelTarget(TORCH_SIGNATURES[torch_version]))

    assert plan.fallback is None
    assert plan.options == options


@pytest.mark.parametrize("torch_version", list(TORCH_SIGNATURES))
def test_kernel_plan_without_grouped_heads_passes_no_gqa(torch_version):
    plan = varlen_kernel_plan(layer_call(kv_heads=NUM_HEADS), KernelTarget(TORCH_SIGNATURES[torch_version]))

    assert "enable_gqa" not in plan.options


@pytest.mark.parametrize(
    "torch_version, expected",
    [("2.10", None), ("2.11", {"window_size": (5, 0), "scale": 0.0625}), ("2.12", {"window_size": (5, 0)})],
)
def test_kernel_plan_of_a_sliding_window_and_a_custom_scale(torch_version, expected):
    window = varlen_kernel_plan(layer_call(sliding_window=6), KernelTarget(TORCH_SIGNATURES[torch_version]))
    custom_scale = varlen_kernel_plan(layer_call(scaling=0.0625), KernelTarget(TORCH_SIGNATURES[torch_version]))

    if expected is None:  # torch 2.10 has neither `window_size` nor `scale`
        assert "sliding window" in window.fallback
        assert "attention scale 0.0625" in custom_scale.fallback
    else:
        assert window.fallback is None and custom_scale.fallback is None
        assert window.options["window_size"] == expected["window_size"]
        assert custom_scale.options["scale"] == 0.0625


def test_kernel_plan_takes_the_default_scale_without_a_scale_parameter():
    for scaling in (None, HEAD_DIM**-0.5, 1 / HEAD_DIM**0.5):
        plan = varlen_kernel_plan(layer_call(scaling=scaling), KernelTarget(TORCH_SIGNATURES["2.10"]))
        assert plan.fallback is None and "scale" not in plan.options


@pytest.mark.parametrize("torch_version", list(TORCH_SIGNATURES))
@pytest.mark.parametrize(
    "needs, reason",
    [
        (dict(softcap=50.0), "softcapping"),
        (dict(sinks=NUM_HEADS), "sinks"),
        (dict(dropout=0.1), "dropout"),
        (dict(dtype=torch.float32), "torch.float32 inputs"),
    ],
    ids=["softcap", "sinks", "dropout", "fp32"],
)
def test_kernel_plan_falls_back_for_what_no_torch_kernel_does(torch_version, needs, reason):
    plan = varlen_kernel_plan(layer_call(**needs), KernelTarget(TORCH_SIGNATURES[torch_version]))

    assert reason in plan.fallback


def test_kernel_plan_falls_back_without_a_way_to_mask_causally():
    plan = varlen_kernel_plan(layer_call(), KernelTarget(POSITIONAL | {"return_aux"}))

    assert "causal masking" in plan.fallback


# ---- the kernel's limits: dtypes, head dims ----


def test_kernel_plan_pads_a_narrower_value_to_the_query_head_dim():
    # Multi-head latent attention (DeepSeek-V3): query and key 192, value 128; the kernel takes one head dim
    plan = varlen_kernel_plan(layer_call(head_dim=192, value_head_dim=128), KernelTarget(TORCH_SIGNATURES["2.12"]))

    assert plan.on_kernel and plan.padded_head_dim == 192 and plan.value_head_dim == 128
    assert plan.padding == "the value padded from 128 to the query's 192"


@pytest.mark.parametrize("torch_version", list(TORCH_SIGNATURES))
def test_kernel_plan_pads_a_head_dim_that_is_not_a_multiple_of_8_and_keeps_its_scale(torch_version):
    plan = varlen_kernel_plan(layer_call(head_dim=100, scaling=None), KernelTarget(TORCH_SIGNATURES[torch_version]))

    if torch_version == "2.10":  # no `scale`: the padded query's default scale would be wrong
        assert "takes no `scale`" in plan.fallback
    else:
        assert plan.padded_head_dim == 104 and plan.value_head_dim == 100
        assert plan.options["scale"] == 100**-0.5


@pytest.mark.parametrize("head_dims", [(512, 512), (288, 256), (192, 320)])
def test_kernel_plan_runs_head_dims_above_256_on_the_memory_efficient_kernel(head_dims):
    head_dim, value_head_dim = head_dims
    layer = layer_call(head_dim=head_dim, value_head_dim=value_head_dim)

    plan = varlen_kernel_plan(layer, KernelTarget(TORCH_SIGNATURES["2.12"], fused=ALL_FUSED))
    alone = varlen_kernel_plan(layer, KernelTarget(TORCH_SIGNATURES["2.12"]))  # a machine without the kernel

    assert plan.kernel == "efficient" and plan.options == {"custom_mask_type": 2, "scale": SCALING}
    assert plan.padded_head_dim in (None, max(head_dims))
    assert (
        alone.fallback == f"head dim {max(head_dims)} (the Flash kernel takes at most 256, and this torch has no "
        "memory-efficient one)"
    )


# Which fused kernels a machine has: any non-None value stands for one (the plan only asks whether it is there)
ALL_FUSED = FusedKernels(efficient=object(), flash_attn_varlen=object(), flex=FlexKernel(object(), object()))
FLEX_ONLY = FusedKernels(efficient=object(), flex=FlexKernel(object(), object()))


@pytest.mark.parametrize(
    "fused, kernel",
    [(ALL_FUSED, "flash_attn"), (FLEX_ONLY, "flex"), (FusedKernels(), None)],
    ids=["flash_attn", "flex", "none"],
)
def test_kernel_plan_of_a_softcapped_layer(fused, kernel):
    plan = varlen_kernel_plan(
        layer_call(softcap=50.0, sliding_window=6), KernelTarget(TORCH_SIGNATURES["2.12"], fused=fused)
    )

    assert plan.kernel == kernel
    if kernel == "flash_attn":
        assert plan.options == dict(softmax_scale=SCALING, causal=True, window_size=(5, 0), softcap=50.0)
    elif kernel == "flex":
        assert plan.options == dict(scale=SCALING, causal=True, sliding_window=6, softcap=50.0)
    else:
        assert "pip install 'flash-attn>=2.6'" in plan.fallback


@pytest.mark.parametrize("torch_version", list(TORCH_SIGNATURES))
@pytest.mark.parametrize("sink_backward", [True, False])
def test_kernel_plan_of_a_layer_with_sinks(torch_version, sink_backward):
    target = KernelTarget(TORCH_SIGNATURES[torch_version], fused=ALL_FUSED, sink_backward=sink_backward)
    plan = varlen_kernel_plan(layer_call(sinks=NUM_HEADS), target)

    if sink_backward:  # every signature returns the log-sum-exp
        assert plan.kernel == "varlen_sinks"
        assert plan.options == varlen_kernel_plan(layer_call(), KernelTarget(TORCH_SIGNATURES[torch_version])).options
    else:
        assert "attention sinks" in plan.fallback


@pytest.mark.parametrize(
    "needs, reason",
    [(dict(sinks=NUM_HEADS), "with attention sinks"), (dict(sliding_window=8), "with a sliding window")],
)
def test_kernel_plan_of_wide_heads_with_what_the_memory_efficient_call_does_not_take(needs, reason):
    plan = varlen_kernel_plan(
        layer_call(head_dim=512, **needs), KernelTarget(TORCH_SIGNATURES["2.12"], fused=ALL_FUSED)
    )

    assert plan.fallback.startswith("head dim 512 " + reason)


def test_kernel_plan_casts_mixed_inputs_to_the_dtype_it_computes_in():
    # TRL's default: float32 queries and keys (RoPE's float32 cos/sin) and bf16 values, under bf16 autocast
    mixed = (torch.float32, torch.float32, torch.bfloat16)
    plan = varlen_kernel_plan(layer_call(input_dtypes=mixed), KernelTarget(TORCH_SIGNATURES["2.12"]))
    assert plan.on_kernel and plan.cast_to == torch.bfloat16

    same = varlen_kernel_plan(layer_call(input_dtypes=(torch.bfloat16,) * 3), KernelTarget(TORCH_SIGNATURES["2.12"]))
    assert same.cast_to is None


@pytest.mark.parametrize(
    "inputs, autocast, weights, expected",
    [
        ((torch.bfloat16,) * 3, None, None, torch.bfloat16),  # bf16 weights
        ((torch.float32, torch.float32, torch.bfloat16), torch.bfloat16, None, torch.bfloat16),  # TRL's default
        ((torch.float32,) * 3, torch.float16, None, torch.float16),  # fp16 autocast
        ((torch.float32, torch.float32, torch.bfloat16), None, torch.bfloat16, torch.bfloat16),  # float32 norms
        ((torch.float32,) * 3, None, torch.float32, torch.float32),  # float32 without autocast: per segment
    ],
    ids=["bf16", "trl_default", "fp16_autocast", "float32_norms", "float32"],
)
def test_the_kernel_computes_in_autocasts_dtype_else_the_weights(inputs, autocast, weights, expected):
    from trl_padfree.modeling.attention.plan import kernel_dtype

    read = []

    def weights_dtype():
        read.append(1)
        return weights

    assert kernel_dtype(inputs, autocast, weights_dtype) == expected
    assert bool(read) == (weights is not None)  # the weights are read only when neither inputs nor autocast decide


def test_a_layer_call_is_read_from_shapes_and_dtypes_alone_and_keys_its_plan():
    # Meta tensors hold no values: a call that read one would fail. TRL's default precision: float32 queries and keys
    # and bf16 values under bf16 autocast; GPT-OSS's sinks, one logit per query head
    query = torch.empty(1, NUM_HEADS, 7, HEAD_DIM, device="meta")
    key = torch.empty(1, NUM_KV_HEADS, 7, HEAD_DIM, device="meta")
    value = torch.empty(1, NUM_KV_HEADS, 7, HEAD_DIM, dtype=torch.bfloat16, device="meta")
    options = dict(scaling=SCALING, sliding_window=4, dropout=0.0, sinks=torch.empty(NUM_HEADS, device="meta"))

    layer = LayerCall.of(query, key, value, None, options, autocast=torch.bfloat16)

    assert layer == LayerCall(
        (torch.float32, torch.float32, torch.bfloat16), torch.bfloat16, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM,
        SCALING, sliding_window=4, sinks=NUM_HEADS,
    )  # fmt: skip
    # The same layer's next call is the same key; another window is another
    assert hash(LayerCall.of(query, key, value, None, options, autocast=torch.bfloat16)) == hash(layer)
    assert LayerCall.of(query, key, value, None, {**options, "sliding_window": None}, autocast=torch.bfloat16) != layer


@pytest.mark.parametrize(
    "head_dim, value_head_dim", [(192, 128), (100, 100), (8, 8)], ids=["latent_value", "not_multiple_of_8", "plain"]
)
def test_the_strict_kernel_gets_padded_inputs_and_the_output_is_cropped(head_dim, value_head_dim):
    from stand_in_kernels import CALLS, calls_of, varlen_stand_in

    from trl_padfree.modeling.check.stand_ins import stand_in_kernels

    lengths = [5, 1, 9]
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, sum(lengths), head_dim, generator=generator)
    key = torch.randn(1, 2, sum(lengths), head_dim, generator=generator)
    value = torch.randn(1, 2, sum(lengths), value_head_dim, generator=generator)
    reference, _ = padfree_varlen_attention(torch.nn.Module(), query, key, value, None, **with_cu_seq_lens(lengths))
    CALLS.clear()

    with stand_in_kernels(varlen=varlen_stand_in("2.15")), torch.autocast("cpu", dtype=torch.bfloat16):
        output, _ = padfree_varlen_attention(torch.nn.Module(), query, key, value, None, **with_cu_seq_lens(lengths))

    (call,) = calls_of("varlen_attn")
    assert call.details["head_dim"] == math.ceil(head_dim / 8) * 8 and call.details["input_dtype"] == torch.bfloat16
    assert output.shape == reference.shape and output.dtype == torch.bfloat16
    torch.testing.assert_close(
        output.float(), reference, atol=BF16_ATTENTION_ATOL, rtol=BF16_ATTENTION_RTOL
    )  # bf16 inputs


def test_installed_torch_has_a_known_varlen_signature():
    # Every name the plan passes exists in one of the signatures above; a torch that renames them fails here
    installed = varlen_kernel().parameters

    assert any(signature <= installed for signature in TORCH_SIGNATURES.values())


# ---- on CUDA (skipped without a GPU) ----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_boundaries(lengths):
    return {
        name: value.cuda() if isinstance(value, torch.Tensor) else value
        for name, value in with_cu_seq_lens(lengths).items()
    }


@pytest.fixture
def varlen_kernel_calls(monkeypatch):
    """Spy on the CUDA kernel path of `padfree_varlen`: the query boundaries of every call."""
    calls = []
    kernel = attention.fused_attention

    def spy(query, key, value, boundaries, *args):
        calls.append(boundaries[0].tolist())
        return kernel(query, key, value, boundaries, *args)

    monkeypatch.setattr(attention, "fused_attention", spy)
    return calls


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernel_runs_chunked_layers_on_chunk_boundaries(varlen_kernel_calls):
    query, key, value = random_qkv()

    output, _ = call_padfree_varlen(
        *(tensor.cuda().bfloat16() for tensor in (query, key, value)),
        module=chunked_layer(),
        **cuda_boundaries(ATTENTION_LENGTHS),
    )

    assert varlen_kernel_calls == [[0, 4, 5, 6, 10, 14, 15]]
    expected = naive_attention(query, key, value, allowed_keys(ATTENTION_LENGTHS, chunk_size=CHUNK_SIZE))
    torch.testing.assert_close(
        output.float().cpu(), expected.float(), atol=BF16_ATTENTION_ATOL, rtol=BF16_ATTENTION_RTOL
    )  # bf16 inputs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "softcap, with_sinks, reason",
    [(SOFTCAP, False, "softcapping"), (None, True, "sinks")],
    ids=["softcap", "sinks"],
)
def test_cuda_falls_back_to_per_segment_attention_and_says_why_once(
    softcap, with_sinks, reason, varlen_kernel_calls, caplog
):
    query, key, value = random_qkv()
    sinks = random_sinks() if with_sinks else None
    boundaries = cuda_boundaries(ATTENTION_LENGTHS)
    attention._log_fallback_once.cache_clear()

    with caplog.at_level(logging.INFO, logger="trl_padfree.modeling.attention.varlen"):
        for _ in range(2):
            output, _ = call_padfree_varlen(
                *(tensor.cuda().bfloat16() for tensor in (query, key, value)),
                softcap=softcap,
                s_aux=None if sinks is None else sinks.cuda().bfloat16(),
                **boundaries,
            )

    assert varlen_kernel_calls == []
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "per-segment" in messages[0] and reason in messages[0]
    expected = naive_attention(query, key, value, allowed_keys(ATTENTION_LENGTHS), softcap, sinks)
    torch.testing.assert_close(
        output.float().cpu(), expected.float(), atol=BF16_ATTENTION_ATOL, rtol=BF16_ATTENTION_RTOL
    )


def test_chunk_boundaries_are_cut_once_per_forward(monkeypatch):
    # Every chunked layer of a packed forward reads the same row, cut once on the host (from the row's host integers)
    calls = []
    cut = rows.chunked_bounds
    monkeypatch.setattr(rows, "chunked_bounds", lambda *args: calls.append(args) or cut(*args))
    model = make_llama4()
    add_packed_forward(model)
    lengths = [9, 1, 6]
    packed = PackedBatch(
        input_ids=torch.arange(sum(lengths)).unsqueeze(0) % 50,
        position_ids=position_ids_from_lengths(lengths),
        completion_mask=torch.ones(1, sum(lengths), dtype=torch.long),
        cu_seq_lens=cu_seq_lens_from_lengths(lengths),
        max_length=max(lengths),
        seq_lens=torch.tensor(lengths),
    )
    with torch.no_grad():
        model(packed_batch=packed, use_cache=False)

    assert len(calls) == 1
    assert sum(t == "chunked_attention" for t in model.config.layer_types) > 1
