"""The sink correction around torch's varlen kernel (trl_padfree/modeling/attention/sinks.py): what it costs per
output element, how exact its kernel-dtype arithmetic is, that it compiles, and that a backward op of a schema it was
not written against is refused at first use.

Bytes are counted by `TensorTraffic`, a dispatch mode that sees every aten op the correction runs around the kernel
(the kernel's own calls not counted), with one rule: an op reads each tensor argument once and writes each tensor it
returns once, in full (a broadcast operand counts its distinct elements); views and `empty` move nothing; an `out=`
argument is written, not read; an in-place argument is read and written. On a GPU each counted op is one kernel
launch that moves those bytes (a CPU op may cast a mixed-dtype operand through a temporary; CUDA's casts on load).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from stand_in_kernels import BACKWARD_OP, CALLS, VARLEN_SIGNATURES, calls_of, varlen_stand_in
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from trl_padfree.integrations.torch import (
    UntestedVarlenBackward,
    varlen_attn_backward_op,
    varlen_backward_schema_refusal,
)
from trl_padfree.modeling.attention.interface import padfree_varlen_attention
from trl_padfree.modeling.attention.sinks import varlen_with_sinks
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.modeling.kernels.attention import VarlenKernel, flash_backend, torch_varlen_kernel
from trl_padfree.packing.layout import cu_seq_lens_from_lengths

# GPT-OSS's attention (64 query heads over 8 key/value heads, head dim 64), on a short row: awkward lengths, one token
HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64
LENGTHS = (37, 1, 90)
CAUSAL = dict(window_size=(-1, 0), enable_gqa=True, scale=HEAD_DIM**-0.5)


class TensorTraffic(TorchDispatchMode):
    """Every aten op run inside, with the bytes it reads and writes (the module docstring's rule); ops inside
    `kernel()` are not recorded."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int, int]] = []
        self._paused = False

    @contextlib.contextmanager
    def kernel(self):
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self._paused:
            self.ops.append((func.overloadpacket.__name__, *_bytes_moved(func, args, kwargs, result)))
        return result

    def launches(self) -> list[str]:
        """The ops that move bytes: on a GPU, one kernel launch each (views and allocations launch none)."""
        return [name for name, read, written in self.ops if read + written]

    def moved(self) -> int:
        return sum(read + written for _, read, written in self.ops)


def _footprint(tensor: torch.Tensor) -> int:
    # The distinct elements a broadcast view addresses (stride 0 repeats one)
    return math.prod(size for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride) * (
        tensor.element_size()
    )


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [each for each in value if isinstance(each, torch.Tensor)]
    return []


def _bytes_moved(func, args, kwargs, result) -> tuple[int, int]:
    schema = func._schema
    is_view = any(out.alias_info is not None and not out.alias_info.is_write for out in schema.returns)
    if is_view or func.overloadpacket.__name__.startswith("empty"):
        return 0, 0
    read = written = 0
    values = {argument.name: value for argument, value in zip(schema.arguments, args, strict=False)} | kwargs
    for argument in schema.arguments:
        for tensor in _tensors(values.get(argument.name)):
            mutated = argument.alias_info is not None and argument.alias_info.is_write
            read += 0 if mutated and argument.kwarg_only else _footprint(tensor)  # an `out=` is only written
            written += _footprint(tensor) if mutated else 0
    for out, value in zip(schema.returns, result if isinstance(result, tuple) else (result,), strict=True):
        if out.alias_info is None:
            written += sum(_footprint(tensor) for tensor in _tensors(value))
    return read, written


# ---- inputs ----


def boundaries() -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


ROW_BOUNDARIES = boundaries()


def row_inputs(dtype=torch.bfloat16, seed=0, sink_scale=2.0):
    """Query, key, value `(T, heads, dim)` in `dtype`, float32 sinks, all requiring grad; the incoming gradient."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    tensors = [
        torch.randn(total, heads, HEAD_DIM, generator=generator).to(dtype).requires_grad_()
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    ]
    sinks = (sink_scale * torch.randn(HEADS, generator=generator)).requires_grad_()
    grad = torch.randn(total, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return (*tensors, sinks), grad


def traffic_kernel(traffic: TensorTraffic) -> VarlenKernel:
    """torch 2.15's stand-in, its forward and backward op calls not counted."""
    stand_in = varlen_stand_in("2.15")

    def uncounted(function):
        def call(*args, **kwargs):
            with traffic.kernel():
                return function(*args, **kwargs)

        return call

    return VarlenKernel(uncounted(stand_in.function), stand_in.capability, backward=uncounted(stand_in.backward))


def sink_attention(inputs, kernel, options=CAUSAL) -> torch.Tensor:
    """The correction as packed attention calls it: inside `flash_backend()` (torch 2.15 would pick cuDNN)."""
    cu_seq = ROW_BOUNDARIES
    with flash_backend():
        return varlen_with_sinks(*inputs, (cu_seq, cu_seq), (max(LENGTHS),) * 2, kernel, options)


# ---- bytes per output element ----

# Per output element (bf16), and per (token, head) row (float32 terms: lse, w, 1 - w, the row sums)
FORWARD_LAUNCHES = ["sub", "sigmoid", "mul"]  # w = sigmoid(lse - s); out' = out * w
FORWARD_BYTES_PER_ELEMENT, FORWARD_BYTES_PER_ROW = 4, 20
# dO = dout * w; the op's generator state; rowsum(dout * out'); 1 - w = sigmoid(s - lse); the sink's gradient
BACKWARD_LAUNCHES = ["mul", "zeros", "mul", "sum", "sub", "sigmoid", "mul", "sum", "neg"]
BACKWARD_BYTES_PER_ELEMENT, BACKWARD_BYTES_PER_ROW = 12, 40


def test_the_sink_correction_moves_4_bytes_per_element_forward_and_12_backward():
    inputs, grad = row_inputs()
    traffic = TensorTraffic()
    kernel = traffic_kernel(traffic)
    elements, rows = sum(LENGTHS) * HEADS * HEAD_DIM, sum(LENGTHS) * HEADS
    per_head = 4 * HEADS  # the float32 sinks and their gradient: read, written

    with traffic:
        output = sink_attention(inputs, kernel)
    assert traffic.launches() == FORWARD_LAUNCHES
    assert traffic.moved() == FORWARD_BYTES_PER_ELEMENT * elements + FORWARD_BYTES_PER_ROW * rows + per_head

    traffic = TensorTraffic()
    output = sink_attention(inputs, traffic_kernel(traffic))
    with traffic:
        torch.autograd.grad(output, inputs, grad)
    assert traffic.launches() == BACKWARD_LAUNCHES
    rng_state = 16  # the backward op's unused generator state, written
    assert traffic.moved() == (
        BACKWARD_BYTES_PER_ELEMENT * elements + BACKWARD_BYTES_PER_ROW * rows + 4 * per_head + rng_state
    )


# ---- exactness of the kernel-dtype arithmetic ----


def recorded(kernel: VarlenKernel, record: dict) -> VarlenKernel:
    """`kernel`, keeping what its forward returned and what its backward op was given."""

    def forward(*args, **kwargs):
        record["output"], record["lse"] = kernel.function(*args, **kwargs)
        return record["output"], record["lse"]

    def backward(grad_out, *args):
        record["grad_out"] = grad_out
        return kernel.backward(grad_out, *args)

    return VarlenKernel(forward, kernel.capability, backward=backward)


@pytest.fixture(autouse=True)
def fresh_records():
    CALLS.clear()
    yield
    CALLS.clear()


# The sink's gradient against float64, over the sum of its terms' magnitudes: measured at most 6.1e-3 (float32 products:
# 3.3e-3) on GPT-OSS-20B's heads (tools/measure/measure_sink_correction.py); bf16 rounds out' by up to 2^-8 = 3.9e-3
SINK_GRAD_ATOL_OF_SCALE = 1.5e-2


def test_the_correction_rounds_once_and_its_sink_gradient_is_within_bf16_of_float64():
    inputs, grad = row_inputs()
    record = {}
    output = sink_attention(inputs, recorded(varlen_stand_in("2.15"), record))
    grads = torch.autograd.grad(output, inputs, grad)

    # out' and dO: the float32 product rounded once to bf16, bit for bit
    kept = torch.sigmoid(record["lse"] - inputs[3].detach().unsqueeze(1)).t().unsqueeze(-1)
    assert torch.equal(output, (record["output"].float() * kept).bfloat16())
    assert torch.equal(record["grad_out"], (grad.float() * kept).bfloat16())
    # The sink's gradient against float64 from the same kernel output, log-sum-exp and gradient
    kept = kept.double()
    terms = (grad.double() * record["output"].double() * kept).sum(-1, keepdim=True) * (1 - kept)
    error = (grads[3].double() + terms.sum((0, 2))).abs()
    assert (error <= SINK_GRAD_ATOL_OF_SCALE * terms.abs().sum((0, 2))).all()


# ---- each release's varlen_attn and backward op ----


@pytest.mark.parametrize("version", list(VARLEN_SIGNATURES))
def test_sinks_run_on_each_release_that_has_the_backward_op_and_per_segment_before(version):
    generator = torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, head_dim = [5, 1, 140], 4, 2, 16  # a segment past 128: where cuDNN could be chosen
    inputs = [
        torch.randn(1, count, sum(lengths), head_dim, generator=generator, requires_grad=True)
        for count in (heads, kv_heads, kv_heads)
    ]
    sinks = torch.randn(heads, generator=generator, requires_grad=True)
    call = dict(scaling=head_dim**-0.5, cu_seq_lens_q=cu_seq_lens_from_lengths(lengths), max_length_q=max(lengths))
    reference, _ = padfree_varlen_attention(torch.nn.Module(), *inputs, None, s_aux=sinks, **call)
    expected = torch.autograd.grad(reference.sum(), (*inputs, sinks))

    with stand_in_kernels(varlen=varlen_stand_in(version)), torch.autocast("cpu", dtype=torch.bfloat16):
        output, _ = padfree_varlen_attention(torch.nn.Module(), *inputs, None, s_aux=sinks, **call)
    got = torch.autograd.grad(output.float().sum(), (*inputs, sinks))

    if version in ("2.10", "2.11"):  # no backward op to hand the corrected output: per segment, exact
        assert not calls_of("varlen_attn")
    else:
        forward, backward = calls_of("varlen_attn"), calls_of("varlen_attn_backward")
        assert [call.details["backend"] for call in forward + backward] == ["flash", "flash"]
    torch.testing.assert_close(output.float(), reference, atol=4e-2, rtol=2e-2)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-1, rtol=5e-2)


def test_on_torch_2_15_a_cudnn_forward_would_not_match_the_backward_the_correction_calls():
    # Why the correction's forward runs inside `flash_backend()`: torch 2.15 would pick cuDNN for this causal row,
    # and the backward op (`backend` Flash unless given) would read cuDNN's log-sum-exp
    lengths = (5, 1, 140)
    cu_seq = torch.tensor([0, 5, 6, 146], dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(146, count, 16, generator=generator).bfloat16().requires_grad_() for count in (4, 2, 2)]
    sinks = torch.randn(4, requires_grad=True)
    arguments = (*inputs, sinks, (cu_seq, cu_seq), (max(lengths),) * 2, varlen_stand_in("2.15"), CAUSAL)

    output = varlen_with_sinks(*arguments)
    assert calls_of("varlen_attn")[-1].details["backend"] == "cudnn"
    with pytest.raises(RuntimeError, match="log-sum-exp of a cudnn forward given to the flash backward"):
        output.sum().backward()

    with flash_backend():
        output = varlen_with_sinks(*arguments)
    output.sum().backward()
    assert [call.details["backend"] for call in CALLS[-2:]] == ["flash", "flash"]


# The backward op's schema of each release: torch/nn/attention/varlen.py of the 2.13.0, 2.14.1 and 2.15.0 wheels
SCHEMA_2_13 = (
    "torch_attn::_varlen_attn_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor lse, Tensor cu_seq_q, Tensor cu_seq_k, SymInt max_q, SymInt max_k, bool is_causal, Tensor rng_state, "
    "float? scale=None, SymInt[]? window_size=None"
)
BACKWARD_SCHEMAS = {"2.13": SCHEMA_2_13, "2.14": SCHEMA_2_13, "2.15": SCHEMA_2_13 + ", int backend=1"}
RESULT = ") -> (Tensor, Tensor, Tensor)"


@pytest.mark.parametrize("version", list(BACKWARD_SCHEMAS))
def test_the_backward_schemas_of_2_13_to_2_15_are_taken(version):
    assert varlen_backward_schema_refusal(torch._C.parse_schema(BACKWARD_SCHEMAS[version] + RESULT)) is None


@pytest.mark.parametrize(
    "schema",
    [
        SCHEMA_2_13 + ", int backend=3" + RESULT,  # cuDNN by default: not the backend the forward ran on
        SCHEMA_2_13 + ", *, int backend" + RESULT,  # a required argument the correction does not pass
        SCHEMA_2_13.replace("Tensor lse, Tensor cu_seq_q", "Tensor cu_seq_q, Tensor lse") + RESULT,  # moved
    ],
    ids=["cudnn_default", "required_backend", "moved"],
)
def test_another_backward_schema_is_refused_at_first_use_naming_torch_and_the_way_out(schema):
    refusal = varlen_backward_schema_refusal(torch._C.parse_schema(schema))
    assert f"torch {torch.__version__}'s varlen attention backward op takes" in refusal
    assert 'attn_implementation="sdpa"' in refusal and "torch from 2.13 to 2.15" in refusal

    stand_in = varlen_stand_in("2.15")
    kernel = VarlenKernel(stand_in.function, stand_in.capability, backward=UntestedVarlenBackward(refusal))
    inputs, _ = row_inputs()
    with pytest.raises(RuntimeError) as raised:
        sink_attention(inputs, kernel)
    assert str(raised.value) == refusal
    assert not CALLS  # refused before the kernel ran


def test_the_installed_torchs_backward_op_is_taken():
    assert torch_varlen_kernel().backward is varlen_attn_backward_op()
    assert not isinstance(varlen_attn_backward_op(), UntestedVarlenBackward)
    assert BACKWARD_OP == "torch_attn::_varlen_attn_backward"


# ---- under torch.compile ----


def compiled_sink_attention(kernel, device, fullgraph):
    cu_seq = boundaries().to(device)

    def attention(query, key, value, sinks):
        return varlen_with_sinks(query, key, value, sinks, (cu_seq, cu_seq), (max(LENGTHS),) * 2, kernel, CAUSAL)

    return torch.compile(attention, backend="aot_eager", fullgraph=fullgraph)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_the_correction_compiles_in_one_graph_around_torchs_op_on_meta_tensors(fresh_dynamo):
    # torch's own `varlen_attn` and backward op, through their registered fakes: no CUDA needed to trace them
    inputs, grad = row_inputs()
    meta = [tensor.detach().to("meta").requires_grad_() for tensor in inputs]

    output = compiled_sink_attention(torch_varlen_kernel(), "meta", fullgraph=True)(*meta)
    grads = torch.autograd.grad(output, meta, grad.to("meta"))

    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert output.shape == grad.shape and output.dtype == torch.bfloat16
    assert [each.shape for each in grads] == [each.shape for each in inputs]


def test_the_compiled_correction_equals_eager_through_the_stand_in(fresh_dynamo):
    # The stand-in reads the boundaries on the host as the kernel does on the device: dynamo breaks its graph there,
    # the correction around it is traced and AOTAutograd builds its backward
    inputs, grad = row_inputs()
    expected = sink_attention(inputs, varlen_stand_in("2.15"))
    with flash_backend():
        output = compiled_sink_attention(varlen_stand_in("2.15"), "cpu", fullgraph=False)(*inputs)
    assert counters["stats"]["unique_graphs"] >= 1

    torch.testing.assert_close(output, expected, atol=0, rtol=0)
    for mine, theirs in zip(
        torch.autograd.grad(output, inputs, grad), torch.autograd.grad(expected, inputs, grad), strict=True
    ):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
