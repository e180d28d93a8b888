"""Token mixers that carry state along the row (hybrid models), kept apart per sequence on a packed row.

Qwen3.5, Qwen3-Next, LFM2, Nemotron-H, Falcon-H1, Bamba, Zamba2 and Granite-4 hybrids mix attention layers with
layers that run a state along the sequence: a short causal convolution, then a gated delta rule or a Mamba2 scan. On
a packed row that state would run from one sequence into the next:

    packed row   | a1 a2 a3 | b1 b2 | c1 c2 c3 c4 |
    one scan     a1 -> a2 -> a3 -> b1 -> ...          b1 would start from a3's state: a leak
    per segment  a1 -> a2 -> a3 | b1 -> b2 | c1 -> ...  each sequence starts fresh, as it does alone

Each such mixer (a module owning a depthwise causal `Conv1d`) gets a forward that, when the packed forward hands it
`MixerSegments`, keeps the sequences apart one of two ways:

- **whole row** (CUDA): one call on the whole row with the boundaries its kernels take, `seq_idx` (segment index per
  token) and `cu_seqlens`; transformers hands its mixers' keyword arguments on to their kernels. Only when every
  kernel function the mixer's forward calls, as transformers resolved it, names its boundary argument (kernels/mixers.py):
  transformers' PyTorch fallbacks, or a function that swallows keywords, run per segment instead.
- **per segment** (CPU, and CUDA without such kernels): the mixer runs once per sequence, its state starting fresh.

With prefix sharing a branch (a rejected sequence, or another completion of a prompt group) has no prompt of its own on
the row; its mixers read the prompt's tokens (`gather_index`) in front of the branch, so their state at the branch is
the one the prompt leaves, and only the branch's outputs are kept. The mixer row holds every sequence of the batch,
also those a prompt group lays out once (the best completion paired with each worse one): run per segment, a mixer's
calls are then one per sequence on every process, as ZeRO-3's weight gathers need. Mixer layers so compute each
sequence as without sharing, attention layers each prompt and distinct sequence once. Which path runs, and why, is
logged once per mixer class (the `trl_padfree.modeling.kernels` logger).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from ..integrations.transformers import kernelized_functions
from ..packing.layout import host_to_device, segment_ids_from_lengths
from ..refusals.forward import check_mixer_conv_width, check_mixer_inputs, check_mixer_segments
from .kernels import log_once
from .kernels.attention import branch_key, takes_cuda_branch
from .kernels.mixers import MixerKernels, conv_kernel_refusing, mixer_kernels

# The keyword argument the packed forward adds for models with stateful mixers; transformers passes it down to them
SEGMENTS_KWARG = "padfree_mixer_segments"
# Keyword arguments of the packed forward that a mixer run on one segment must not see: its fallback kernels refuse
# boundaries ("can't keep packed sequences apart without ..."), and a segment needs none
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "packed_row", "seq_idx")
# Every name transformers gives a model's or layer's cache: 5.24 renamed `past_key_values` and `cache_params` to
# `cache`, and keeps the old names (deprecated) until 5.40. A packed forward refuses a live cache under any of them.
CACHE_KWARGS = ("cache", "past_key_values", "cache_params", "past_key_value")


@dataclass
class MixerSegments:
    """The sequences of one packed row as a mixer must see them.

    `bounds` are `[start, end)` ranges of the *mixer row*: the packed row itself, or with prefix sharing the row with
    each shared prompt repeated in front of its rejected branch (`gather_index` reads it from the packed row,
    `output_index` takes each packed position's output back from it).
    """

    bounds: list[tuple[int, int]]
    cu_seqlens: torch.Tensor  # (segments + 1,) int32, of the mixer row
    seq_idx: torch.Tensor  # (1, mixer row length) int32: the segment of each token
    gather_index: torch.Tensor | None = None
    output_index: torch.Tensor | None = None

    @classmethod
    def from_lengths(cls, lengths: list[int], gather_index=None, output_index=None, device=None) -> MixerSegments:
        lengths = [length for length in lengths if length > 0]
        ends = list(itertools.accumulate(lengths, initial=0))
        cu_seqlens = host_to_device(torch.tensor(ends, dtype=torch.int32), device or torch.device("cpu"))
        seq_idx = segment_ids_from_lengths(torch.tensor(lengths)).to(torch.int32)
        seq_idx = host_to_device(seq_idx, device or torch.device("cpu"))
        return cls(list(itertools.pairwise(ends)), cu_seqlens, seq_idx.unsqueeze(0), gather_index, output_index)

    @classmethod
    def of_packed_batch(cls, packed) -> MixerSegments:
        """The segments of a `packed_forward.PackedBatch`, from its host integers: its segments, or with prefix
        sharing every sequence's prompt and own tokens laid out one after another, then the row's padding."""
        device = packed.input_ids.device
        host = packed.host
        if not any(host.prefix_lens) and len(host.laid_out) == len(host.seq_lens):  # a segment per sequence
            return cls.from_lengths(
                [end - start for start, end in itertools.pairwise(host.cu_seq_lens)], device=device
            )
        spans, own = [], []  # the mixer row: row positions, and whether each is its sequence's own token
        for sequence in range(len(host.seq_lens)):
            start, length = host.seq_starts[sequence], host.seq_lens[sequence]
            prefix_start, prefix = host.prefix_starts[sequence], host.prefix_lens[sequence]
            spans += [range(prefix_start, prefix_start + prefix), range(start, start + length - prefix)]
            own += [False] * prefix + [True] * (length - prefix)
        real, row_length = host.real_row_tokens, packed.row_length
        spans.append(range(real, row_length))
        own += [True] * (row_length - real)
        gather_index = torch.tensor([position for span in spans for position in span], dtype=torch.long)
        own = torch.tensor(own)
        output_index = torch.full((row_length,), -1, dtype=torch.long)
        # (sequences that read the same tokens compute equal outputs: the last one's are kept)
        output_index[gather_index[own]] = torch.arange(len(gather_index))[own]
        if bool((output_index < 0).any()):
            raise ValueError("Prefix-sharing row: some positions belong to no sequence (a collator bug).")
        lengths = [*host.seq_lens, row_length - real]
        return cls.from_lengths(
            lengths, host_to_device(gather_index, device), host_to_device(output_index, device), device
        )

    def run(self, mixer_forward, hidden_states: torch.Tensor, kwargs: dict, whole_row: bool) -> torch.Tensor:
        """`mixer_forward` on `hidden_states` (1, T, hidden) with every sequence kept apart: in one call given the
        boundaries (`whole_row`), or once per sequence."""
        mixer_row = hidden_states if self.gather_index is None else hidden_states[:, self.gather_index]
        if whole_row:
            kernel_kwargs = {"cu_seq_lens_q": self.cu_seqlens, "seq_idx": self.seq_idx}
            outputs = mixer_forward(mixer_row, **kwargs, **kernel_kwargs)
        else:
            outputs = torch.cat(
                [mixer_forward(mixer_row[:, start:end], **kwargs) for start, end in self.bounds], dim=1
            )
        return outputs if self.output_index is None else outputs[:, self.output_index]


def stateful_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` that carry state along the row: those owning a depthwise causal `Conv1d` (the short
    convolution every gated-delta, Mamba2 and LFM2 mixer opens with)."""
    return [
        module for module in model.modules() if any(_is_causal_depthwise_conv(child) for child in module.children())
    ]


def _is_causal_depthwise_conv(module: torch.nn.Module) -> bool:
    return (
        isinstance(module, torch.nn.Conv1d)
        and module.groups == module.in_channels
        and module.padding == (module.kernel_size[0] - 1,)
    )


@functools.cache
def _kernels_of(mixer_class: type, kernels_in_force: object) -> MixerKernels:
    # Read at a class's first packed forward, once per set of kernels in force (stand-ins change them)
    return mixer_kernels(mixer_class)


def add_segmented_mixers(mixers: list[torch.nn.Module]) -> list[str]:
    """Give every stateful mixer of a model (`stateful_mixers`) a forward that honours `MixerSegments` (idempotent);
    returns their class names. Outside packed forwards (no `padfree_mixer_segments` keyword) the mixers run as
    before."""
    for mixer in mixers:
        width = next(child.kernel_size[0] for child in mixer.children() if _is_causal_depthwise_conv(child))
        refusing = conv_kernel_refusing(type(mixer), width)
        check_mixer_conv_width(
            type(mixer).__name__, width, None if refusing is None else (refusing.described, refusing.distribution)
        )
        if not getattr(mixer, "_padfree_segmented", False):
            mixer.forward = _segmented_forward(mixer, mixer.forward)
            mixer._padfree_segmented = True
            mixer._padfree_calls = mixer._padfree_segmented_calls = mixer._padfree_whole_row_calls = 0
    return sorted({type(mixer).__name__ for mixer in mixers})


def mixers_run_per_segment(model: torch.nn.Module, device: torch.device) -> list[str]:
    """The classes of `model`'s stateful mixers whose packed forward will run once per sequence on `device` (so as
    many times as the row holds sequences): every one on CPU, on CUDA those whose kernels cannot take a whole row."""
    mixers = stateful_mixers(model)
    on_cuda_branch = takes_cuda_branch(torch.empty(0, device=device))
    return sorted(
        {
            type(mixer).__name__
            for mixer in mixers
            if not (on_cuda_branch and _kernels_of(type(mixer), branch_key()).whole_row) or kernelized_functions(mixer)
        }
    )


def mixer_classes(model: torch.nn.Module) -> list[str]:
    return sorted({type(mixer).__name__ for mixer in stateful_mixers(model)})


@dataclass(frozen=True)
class MixerCalls:
    """How often a mixer class's layers ran: in all, with the row's segments, and of those on the whole row."""

    ran: int = 0
    segmented: int = 0
    whole_row: int = 0


def mixer_calls(model: torch.nn.Module) -> dict[str, MixerCalls]:
    """Per mixer class, how its mixers ran (the architecture check asserts that every mixer a packed forward runs gets
    its segments, and names the whole-row kernels of a leak)."""
    calls: dict[str, MixerCalls] = {}
    for mixer in stateful_mixers(model):
        seen = calls.get(type(mixer).__name__, MixerCalls())
        calls[type(mixer).__name__] = MixerCalls(
            seen.ran + mixer._padfree_calls,
            seen.segmented + mixer._padfree_segmented_calls,
            seen.whole_row + mixer._padfree_whole_row_calls,
        )
    return calls


def _segmented_forward(mixer: torch.nn.Module, inner_forward):
    mixer_class = type(mixer).__name__

    @functools.wraps(inner_forward)
    def forward(*args, **kwargs):
        mixer._padfree_calls += 1
        segments = kwargs.pop(SEGMENTS_KWARG, None)
        if segments is None:
            check_mixer_segments(mixer_class, packed_without_segments=kwargs.get("cu_seq_lens_q") is not None)
            return inner_forward(*args, **kwargs)
        hidden_states = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        live_cache = bool(args[1:]) or any(kwargs.get(name) is not None for name in CACHE_KWARGS)
        check_mixer_inputs(mixer_class, live_cache, has_mask=kwargs.get("attention_mask") is not None)
        for name in _PACKING_KWARGS:
            kwargs.pop(name, None)
        hub_kernels = kernelized_functions(mixer)
        if takes_cuda_branch(hidden_states) and hub_kernels:
            # `use_kernels=True`: hub kernels replaced transformers' functions, and what they take is not readable
            whole_row = False
            log_once(
                f"{mixer_class} layers run once per sequence of the packed row, state starting fresh (kernelized: "
                f"trl-padfree cannot tell whether the hub kernels for {', '.join(hub_kernels)} keep sequences apart)."
            )
        elif takes_cuda_branch(hidden_states):
            kernels = _kernels_of(type(mixer), branch_key())
            whole_row = kernels.whole_row
            kernels.log()
        else:
            whole_row = False
            log_once(f"{mixer_class} layers run once per sequence of the packed row, state starting fresh (on CPU).")
        mixer._padfree_segmented_calls += 1
        mixer._padfree_whole_row_calls += whole_row
        return segments.run(inner_forward, hidden_states, kwargs, whole_row)

    return forward
