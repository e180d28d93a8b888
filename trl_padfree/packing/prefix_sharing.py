"""Prefix sharing: each prompt computed once per batch, for every completion of it.

    unshared row   | p0 p1 p2 p3 c0 c1 | p0 p1 p2 p3 r0 r1 r2 |
    shared row     | p0 p1 p2 | p3 c0 c1 | p3 r0 r1 r2 |
    position_ids   | 0  1  2  | 3  4  5  | 3  4  5  6  |
                     prefix     chosen     rejected branch: attends to the prefix and to itself, never to the
                                branch     chosen branch; its positions continue from the prefix

Both branches open with the last prompt token. A causal LM scores each token from the position before it, and one
position scores one next token, so the rejected branch repeats p3 to score r0 from it. p3 sees the same prefix at the
same position in both branches, so its hidden states are equal: one token per pair is computed twice instead of the
whole prompt, and every token is scored exactly as in the unshared layout.

Attention for that layout (modeling/attention/rows.py) is one varlen call per layer. The queries are the row as it is;
the keys are gathered so that each segment has its own tokens, except a rejected branch, which has its prefix first:

    queries      | p0 p1 p2 p3 c0 c1 |          p3 r0 r1 r2 |        cu_seq_lens_q  0 6 10
    keys         | p0 p1 p2 p3 c0 c1 | p0 p1 p2 p3 r0 r1 r2 |        cu_seq_lens_k  0 6 13

Causal attention aligned to the bottom-right corner (flash attention's varlen convention, and the per-segment
reference's) then lets branch token i see the whole prefix and the branch up to itself: exactly the keys of the
unshared rejected sequence.

Prompt groups generalize the pair: the sequences of a batch whose truncated prompts are token-identical (a prompt's K
completions, paired any way) lay the prompt out once, their first sequence whole and every other distinct one as a
branch reading it; a sequence equal in every token to one laid out (the best completion, paired with each worse one)
reads that one's tokens, so several sequences share a row start:

    K = 4 all pairs    sequences a>b a>c a>d b>c b>d c>d: 12, of 4 distinct completions
    grouped row        | p0 p1 p2 p3 a0 a1 | p3 b0 | p3 c0 c1 c2 | p3 d0 d1 |      one prompt, 4 completions

Every rule of the layout is here, on host integers: each pair's prefix (`shared_prefix_length`), the row laid out in
prompt groups (`grouped_row_layout`, a vision batch's keyed by its images), which the collator turns into
its `HostRow`, and the keys each segment reads (`segment_keys`, `shared_prefix_keys`), which the row of a `HostRow`
gathers (modeling/attention/rows.py); and `prefix_sharing="auto"`'s cost model. docs/concepts/prefix-sharing.md walks
the setting from the config to the kernel.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ..costs.flops import DecoderShape, Segment, packed_row_work, training_step_flops
from .layout import HostRow, kept_prompt_and_completion, pair_tokens
from .prompt_groups import prompt_groups

logger = logging.getLogger(__name__)

# The prefix holds the prompt but its last token, which both branches repeat: shorter prompts share nothing
MIN_SHARED_PROMPT_TOKENS = 2
# Shorter prompts are laid out unshared by default: on 2 CPU cores (small demo Llama, 100-300 token completions) a
# shared pair was 0.95x as fast at 2 prompt tokens, 0.99x at 4, 1.01x at 8 and 1.16x at 64 (docs/concepts/prefix-sharing.md)
DEFAULT_MIN_PROMPT_TOKENS = 8


def shared_prefix_length(chosen_prompt: int, rejected_prompt: int, min_prompt_tokens: int) -> int:
    """Tokens of the shared prefix, from the prompt tokens each truncated sequence starts with; 0 lays the pair out
    unshared.

    Both sequences start with the same prompt tokens exactly when they kept the same number of them (truncation cuts
    the same prompt from one end), and a shorter prompt than `min_prompt_tokens` is not worth the second attention
    call.
    """
    if chosen_prompt != rejected_prompt or chosen_prompt < max(MIN_SHARED_PROMPT_TOKENS, min_prompt_tokens):
        return 0
    return chosen_prompt - 1


def pair_row_tokens(
    prompt: int,
    chosen: int,
    rejected: int,
    max_length: int | None,
    truncation_mode: str = "keep_start",
    min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS,
) -> int:
    """Tokens a pair adds to a prefix-sharing row: both truncated sequences, less the shared prefix."""
    prefix = shared_prefix_length(
        kept_prompt_and_completion(prompt, chosen, max_length, truncation_mode)[0],
        kept_prompt_and_completion(prompt, rejected, max_length, truncation_mode)[0],
        min_prompt_tokens,
    )
    return pair_tokens(prompt, chosen, rejected, max_length) - prefix


def shared_row_layout(
    chosen_lengths: Sequence[int], rejected_lengths: Sequence[int], prefixes: Sequence[int]
) -> tuple[list[tuple[int, int]], list[int], list[int], list[int]]:
    """A batch's row laid out pair by pair, `[prefix + chosen branch]` then `[rejected branch]`, the rejected sequence
    reading the first `prefixes[pair]` tokens of the chosen one (0: the pair's two sequences laid out whole). Prefix
    sharing lays batches out in prompt groups (`grouped_row_layout`, this row for distinct prompts); "auto" lays a
    batch it leaves unshared out this way, every prefix 0.

    Returns, per segment, the sequence it holds (chosen ones, then rejected ones) and from which of its tokens on; and
    per sequence, the row start of its own tokens, the row start of the prefix it reads first, and that prefix's
    tokens (0 if none).
    """
    pairs = len(prefixes)
    sources = []
    seq_starts, prefix_starts, prefix_lens = [0] * 2 * pairs, [0] * 2 * pairs, [0] * 2 * pairs
    offset = 0
    for pair, prefix in enumerate(prefixes):
        sources += [(pair, 0), (pairs + pair, prefix)]
        seq_starts[pair] = offset
        offset += chosen_lengths[pair]
        seq_starts[pairs + pair] = offset
        prefix_starts[pairs + pair] = seq_starts[pair]
        prefix_lens[pairs + pair] = prefix
        offset += rejected_lengths[pair] - prefix
    return sources, seq_starts, prefix_starts, prefix_lens


def grouped_row_layout(
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    min_prompt_tokens: int,
    keys: Sequence[Hashable] | None = None,
) -> tuple[list[tuple[int, int]], list[int], list[int], list[int]]:
    """A batch's row laid out in prompt groups: the sequences (chosen ones, then rejected ones, as truncated) whose
    kept prompt tokens (`prompt_lens[sequence]` of them) are identical form one group, laid out once, in the order the
    groups first appear pair by pair:

        group   | p0 p1 p2 p3 a0 a1 | p3 b0 | p3 c0 c1 c2 | p3 d0 d1 |      K = 4 completions, any pairing
                  a, whole            b, c, d: branches reading p0 p1 p2

    The group's first sequence is laid out whole, every other distinct one as a branch reading the first
    `prompt - 1` tokens of the first (as `shared_row_layout`'s rejected branch), and a sequence equal in every token
    to one already laid out (the best completion paired with each worse one) reads that one's tokens: several
    sequences with the same row start and prefix. A sequence whose prompt is shorter than `min_prompt_tokens` (and 2)
    is laid out whole and alone. Batches with distinct prompts get `shared_row_layout`'s row (but for a pair whose
    chosen and rejected sequences are equal: laid out once). With `keys` (one per sequence), sequences group only
    where their keys are equal too: what else must match, e.g. a digest of their images (packing/vision.py).

    Returns what `shared_row_layout` returns; a segment's sequence is the first that reads it.
    """
    pairs = len(sequences) // 2
    in_pair_order = [sequence for pair in range(pairs) for sequence in (pair, pairs + pair)]
    minimum = max(MIN_SHARED_PROMPT_TOKENS, min_prompt_tokens)
    prompts = [sequences[sequence][: prompt_lens[sequence]] for sequence in in_pair_order]
    alone = [None if prompt_lens[sequence] >= minimum else sequence for sequence in in_pair_order]
    if keys is not None:
        alone = [(mark, keys[sequence]) for mark, sequence in zip(alone, in_pair_order, strict=True)]
    sources = []
    seq_starts, prefix_starts, prefix_lens = [0] * len(sequences), [0] * len(sequences), [0] * len(sequences)
    offset = 0
    for group in prompt_groups(prompts, keys=alone):
        first = in_pair_order[group[0]]
        laid_out: dict[tuple[int, ...], int] = {}  # each distinct sequence of the group, by its tokens
        for sequence in (in_pair_order[position] for position in group):
            same = laid_out.setdefault(tuple(sequences[sequence]), sequence)
            if same != sequence:
                seq_starts[sequence], prefix_starts[sequence] = seq_starts[same], prefix_starts[same]
                prefix_lens[sequence] = prefix_lens[same]
                continue
            sources.append((sequence, 0 if sequence == first else prompt_lens[first] - 1))
            seq_starts[sequence] = offset
            if sequence != first:  # a branch
                prefix_starts[sequence], prefix_lens[sequence] = seq_starts[first], prompt_lens[first] - 1
            offset += len(sequences[sequence]) - prefix_lens[sequence]
    return sources, seq_starts, prefix_starts, prefix_lens


def segment_keys(row: HostRow) -> list[list[tuple[int, int]]]:
    """Per segment of `row`, the `[start, end)` row ranges its queries read as keys, in order: its own tokens, after
    the prefix it reads when it is a prefix-sharing branch."""
    prefixes = {
        row.segment_of(start): (prefix_start, prefix_len)
        for start, prefix_start, prefix_len in zip(row.seq_starts, row.prefix_starts, row.prefix_lens, strict=True)
        if prefix_len > 0
    }
    ranges = []
    for segment, (start, end) in enumerate(itertools.pairwise(row.cu_seq_lens)):
        prefix_start, prefix_len = prefixes.get(segment, (0, 0))
        ranges.append(([(prefix_start, prefix_start + prefix_len)] if prefix_len else []) + [(start, end)])
    return ranges


def shared_prefix_keys(row: HostRow) -> tuple[tuple[range, tuple[range, ...]], ...] | None:
    """The keys of a prefix-sharing row's attention, as host integers: per segment, its queries (its row positions)
    and the row ranges of its keys, its own tokens after a rejected branch's prefix; None when no pair of the row
    shares its prefix."""
    keys = segment_keys(row)
    if all(len(ranges) == 1 for ranges in keys):
        return None
    return tuple(
        (range(start, end), tuple(range(*span) for span in ranges))
        for (start, end), ranges in zip(itertools.pairwise(row.cu_seq_lens), keys, strict=True)
    )


class PrefixSharing(enum.Enum):
    """`prefix_sharing` as set (`True`, `False` or `"auto"`, its `value`): off, every batch's prompts shared, or each
    batch shared when the cost model says it pays. Truthy unless off."""

    OFF = False
    ON = True
    AUTO = "auto"

    @classmethod
    def of(cls, setting: bool | str | PrefixSharing) -> PrefixSharing:
        return setting if isinstance(setting, cls) else cls(setting)

    def __bool__(self) -> bool:
        return self is not PrefixSharing.OFF

    def sized_min_prompt_tokens(self, min_prompt_tokens: int) -> int | None:
        """The shortest prompt a text pair's size (token budget) or price (balancing) counts shared; None: every pair
        unshared. "auto" may lay a batch out unshared, so its pairs are sized unshared, the larger."""
        return min_prompt_tokens if self is PrefixSharing.ON else None

    def grouped_min_prompt_tokens(self, min_prompt_tokens: int) -> int | None:
        """The shortest prompt a group of one prompt's pairs shares (the collator's grouping); None when off. Under
        "auto" every prompt that can share may, as each batch's cost decides."""
        if self is PrefixSharing.OFF:
            return None
        return MIN_SHARED_PROMPT_TOKENS if self is PrefixSharing.AUTO else min_prompt_tokens


# ---- prefix_sharing="auto": share a batch's prompts when the cost model says it pays ----

# What gathering one key or value element costs, in FLOPs the device could have done meanwhile: its arithmetic over its
# memory bandwidth. A GPU (H100: ~989 TFLOP/s in bf16 over ~3.35 TB/s, 2-byte elements) ~600; a 2-core CPU (~50 GFLOP/s
# in fp32 over ~10 GB/s, 4-byte elements) ~20. Estimates: the decision only needs their order of magnitude
GATHER_FLOPS_PER_ELEMENT = {"cuda": 600.0, "cpu": 20.0}
# The gather runs in the policy's forward, its backward (a scatter-add) and the reference's forward
GATHER_PASSES = 3

_OUTCOMES_LOGGED: set[bool] = set()  # once per process for each outcome, as the kernels' choices are


@dataclass(frozen=True)
class SharingCost:
    """The cost model behind `prefix_sharing="auto"`, for one model: a batch is laid out shared when its step's FLOPs
    with the shared layout (fewer tokens, less attention: costs/flops.py) plus the keys' and values' gather (each
    attention layer copies the row's keys and values, every prefix's again) cost less than the unshared layout's."""

    shape: DecoderShape
    key_value_width: int  # key-value heads x head dim
    gather_flops_per_element: float

    @classmethod
    def of_model(cls, model: torch.nn.Module, device_type: str = "cuda") -> SharingCost:
        """From a causal LM: its config's attention shape, its linear parameters counted (any architecture; ZeRO-3's
        partitioned parameters by their full size), the gather priced for `device_type`."""
        text = model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        gather = GATHER_FLOPS_PER_ELEMENT.get(device_type, GATHER_FLOPS_PER_ELEMENT["cuda"])
        return cls(DecoderShape.of_model(model), kv_heads * head_dim, gather)

    def step_costs(self, lengths: list[tuple[int, int]], prefixes: list[int], scored: int) -> tuple[float, float]:
        """(unshared, shared) costs of a batch laid out pair by pair: `lengths` the (chosen, rejected) tokens of each
        pair, `prefixes` the tokens each rejected sequence would read from its chosen one, `scored` the completion
        tokens (`row_costs` of the pairs' segments)."""
        sequence_lengths = [length for pair in lengths for length in pair]
        return self.row_costs(sequence_lengths, pair_segments(lengths, prefixes), scored, scored)

    def row_costs(
        self, sequence_lengths: list[int], segments: list[Segment], scored: int, row_scored: int
    ) -> tuple[float, float]:
        """(unshared, shared) costs of a batch: `sequence_lengths` its sequences' tokens (the unshared row's
        segments), `segments` the shared row's (each reading its prefix), `scored` the sequences' completion tokens,
        `row_scored` the shared row's (fewer where a prompt group lays identical sequences out once)."""
        unshared_cost = training_step_flops(self.shape, packed_row_work(sequence_lengths, scored))
        shared_cost = training_step_flops(self.shape, packed_row_work(segments, row_scored))
        gathered = sum(segment.length + segment.prefix for segment in segments)  # every key, each prefix again
        gather = GATHER_PASSES * self.shape.attention_layers * 2 * self.key_value_width * gathered
        return float(unshared_cost), shared_cost + gather * self.gather_flops_per_element


def pair_segments(lengths: list[tuple[int, int]], prefixes: list[int]) -> list[Segment]:
    """The segments of pairs laid out pair by pair: `[prefix + chosen branch]`, `[rejected branch]`."""
    return [
        segment
        for (chosen, rejected), prefix in zip(lengths, prefixes, strict=True)
        for segment in (Segment(chosen), Segment(rejected - prefix, prefix=prefix))
    ]


def layout_pays(
    cost: SharingCost | None, sequence_lengths: list[int], segments: list[Segment], scored: int, row_scored: int
) -> bool:
    """Whether `prefix_sharing="auto"` lays this batch out shared (`SharingCost.row_costs`' arguments); logged once
    per outcome, with the reason."""
    if sum(segment.length for segment in segments) == sum(sequence_lengths):  # nothing shared
        return False
    if cost is None:  # a collator used without a trainer: no model to weigh
        return True
    unshared, shared = cost.row_costs(sequence_lengths, segments, scored, row_scored)
    share = shared < unshared
    if share not in _OUTCOMES_LOGGED:
        _OUTCOMES_LOGGED.add(share)
        verdict = "shares the prompts of" if share else "lays out unshared"
        logger.info(
            f'prefix_sharing="auto" {verdict} a batch whose shared layout the cost model puts at {shared / unshared:.3f}x '
            "the unshared one's cost (step FLOPs, the keys' and values' gather included; docs/concepts/prefix-sharing.md). "
            "Logged once per outcome."
        )
    return share


def sharing_summary(
    pairs: list[tuple[int, int, int]], max_length: int | None, truncation_mode: str, min_prompt_tokens: int
) -> tuple[int, float]:
    """How many of these `(prompt, chosen, rejected)` token counts share their prompt, and the fraction of row
    tokens sharing saves."""
    shared_pairs = unshared_tokens = shared_tokens = 0
    for prompt, chosen, rejected in pairs:
        shared = pair_row_tokens(prompt, chosen, rejected, max_length, truncation_mode, min_prompt_tokens)
        unshared = pair_tokens(prompt, chosen, rejected, max_length)
        shared_pairs += shared < unshared
        unshared_tokens += unshared
        shared_tokens += shared
    return shared_pairs, 1.0 - shared_tokens / max(unshared_tokens, 1)


def log_sharing_summary(dataset, max_length: int | None, truncation_mode: str, min_prompt_tokens: int) -> None:
    """Say (INFO) how much of a training set TRL tokenized prefix sharing lays out shared; the rest falls back to
    unshared. Silent for a streamed dataset, which has no columns to read without consuming it."""
    import datasets

    if not logger.isEnabledFor(logging.INFO) or not isinstance(dataset, datasets.Dataset):
        return
    if not {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(dataset.column_names):
        return
    columns = (dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])
    lengths = [(len(prompt), len(chosen), len(rejected)) for prompt, chosen, rejected in zip(*columns, strict=True)]
    shared_pairs, saved = sharing_summary(lengths, max_length, truncation_mode, min_prompt_tokens)
    logger.info(
        f"Prefix sharing: {shared_pairs} of {len(lengths)} training pairs share their prompt, {saved:.1%} fewer row "
        f"tokens; the other pairs (prompts under {min_prompt_tokens} tokens, or chosen and rejected truncated into "
        "the prompt differently) are laid out unshared."
    )
