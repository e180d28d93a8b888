"""Training FLOPs of a DPO step, padded or packed: what a layout of the same pairs costs in arithmetic.

Pure arithmetic on plain integers (no torch, no transformers import): the bench holds its measured speedups against
it, and a cost model of prefix sharing or a balancer of rows across ranks can add up the same units.

The model, per forward of a batch (multiply-adds count 2 FLOPs):

    linear      2 x linear_params x tokens             every token, padding included, through every projection and
                                                       MLP (MoE: the active experts); embeddings are a lookup
    LM head     2 x hidden x vocab x scored_tokens     TRL's fused head scores completion tokens only
    attention   2 x 2 x heads x head_dim x pairs       QK^T and PV, per attention layer, over the (query, key) pairs
                    x attention_layers                 the kernel computes

A causal segment of L tokens has L(L+1)/2 pairs; a branch of B tokens that reads a shared prompt of P tokens laid out
elsewhere in the row (prefix sharing) has B*P + B(B+1)/2. A padded batch of n sequences padded to L has n*L tokens and
n*L^2 pairs: under a padding mask sdpa computes the whole square (no kernel skips the causal half of an explicit
mask); only a batch without padding runs causal, n*L(L+1)/2. One DPO step = the policy's forward and backward (3
forwards: the backward computes input and weight gradients, two forwards' worth) + the reference's forward (1).

Not counted: norms, activations, softmax, rotary embeddings, the loss, the optimizer step (elementwise, or the same in
every layout). The ratio of two layouts' FLOPs does not depend on the constant factors (2 per multiply-add, 4
forwards): `flop_ideal_speedup`.

Use: a `DecoderShape` (`DecoderShape.from_config(config)`, or counted), a `BatchWork` per batch or row
(`padded_batch_work`, `packed_row_work` over `Segment`s, a shared pair `Segment(prompt + chosen)`,
`Segment(rejected, prefix=prompt)`; works add up), then `forward_flops`, `training_step_flops` or `flop_ideal_speedup`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FLOPS_PER_MULTIPLY_ADD = 2
POLICY_FORWARDS = 3  # forward + backward (input and weight gradients: two forwards' worth)
REFERENCE_FORWARDS = 1
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # sliding windows counted in full: an upper bound
# The names configs give their expert count (modeling/fused_lm_head.py keeps the same list for TRL's head)
EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class DecoderShape:
    """What the FLOP model needs of a decoder.

    Args:
        linear_params: parameters each token passes through: every layer's attention projections and MLP (for a
            mixture of experts, the router, the shared experts and `num_experts_per_tok` routed ones), excluding the
            input embedding and the LM head.
        hidden_size: width of the LM head's input.
        vocab_size: rows of the LM head.
        attention_layers: layers that attend over the sequence (a hybrid's linear-attention or convolution layers are
            linear in tokens: their parameters are in `linear_params`, they have no pairs).
        num_attention_heads: query heads (grouped-query attention shares keys but computes one score per query head).
        head_dim: width of one head.
        num_key_value_heads: key and value heads (grouped-query attention); None: one per query head.
    """

    linear_params: int
    hidden_size: int
    vocab_size: int
    attention_layers: int
    num_attention_heads: int
    head_dim: int
    num_key_value_heads: int | None = None

    @property
    def key_value_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @classmethod
    def from_config(cls, config, linear_params: int | None = None) -> DecoderShape:
        """The shape of a transformers config (or anything with its attribute names; a composite model's text config
        is used). `linear_params` defaults to the attention projections and a gated (3-matrix) MLP per layer, with
        MoE fields read where present; pass it counted for other architectures (hybrids, non-gated MLPs), whose
        config the formula would get wrong: those are refused rather than miscounted.
        """
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        hidden_size, num_layers = config.hidden_size, config.num_hidden_layers
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden_size // num_heads
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
        attention_layers = sum(layer_type in ATTENTION_LAYER_TYPES for layer_type in layer_types)
        if linear_params is None:
            if attention_layers != num_layers:
                others = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
                raise ValueError(
                    f"DecoderShape.from_config models attention + MLP layers only, not {others}: pass linear_params "
                    "(the counted parameters of the layers, embeddings and LM head excluded)."
                )
            linear_params = sum(
                _attention_projection_params(config, head_dim) + _mlp_params(config, index)
                for index in range(num_layers)
            )
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(linear_params, hidden_size, config.vocab_size, attention_layers, num_heads, head_dim, num_kv_heads)

    @classmethod
    def of_model(cls, model) -> DecoderShape:
        """The shape of a loaded model: its text config's attention shape and its parameters counted (any
        architecture; ZeRO-3's partitioned parameters by their full size), embeddings and LM head excluded. A
        vision-language model's vision tower counts as per-token linear work: an overestimate of its text tokens'
        cost, the same for every row."""
        outside = {
            id(p)
            for module in (model.get_input_embeddings(), model.get_output_embeddings())
            if module is not None
            for p in module.parameters()
        }
        linear = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if id(p) not in outside)
        text_config = model.config.get_text_config()
        return cls.from_config(text_config, linear_params=linear)


def _attention_projection_params(config, head_dim: int) -> int:
    # q and o: heads x head_dim each way; k and v: key-value heads x head_dim
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return config.hidden_size * head_dim * (2 * num_heads + 2 * num_kv_heads)


def _mlp_params(config, layer_index: int) -> int:
    """Active MLP parameters of one layer: gate, up and down projections; for a MoE layer the router, the routed
    experts a token visits and the shared experts."""
    hidden_size = config.hidden_size
    num_experts = max((getattr(config, name, None) or 0 for name in EXPERT_COUNT_NAMES), default=0)
    dense_layers = set(getattr(config, "mlp_only_layers", None) or [])  # Qwen-MoE's dense layers
    dense_layers |= set(range(getattr(config, "first_k_dense_replace", None) or 0))  # DeepSeek's
    if not num_experts or layer_index in dense_layers:
        return 3 * hidden_size * config.intermediate_size
    expert_size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared_size = (getattr(config, "n_shared_experts", None) or 0) * expert_size
    shared_size += getattr(config, "shared_expert_intermediate_size", None) or 0
    routed_size = config.num_experts_per_tok * expert_size
    return hidden_size * num_experts + 3 * hidden_size * (routed_size + shared_size)


@dataclass(frozen=True)
class Segment:
    """One causal attention span of a packed row: `length` query tokens attending to `prefix` earlier tokens (a
    shared prompt laid out elsewhere in the row) and causally to themselves."""

    length: int
    prefix: int = 0


@dataclass(frozen=True)
class BatchWork:
    """What one forward processes: tokens through the linear layers, tokens scored by the LM head, and (query, key)
    pairs per attention layer. Works add up (`sum(works, BatchWork())`), e.g. the rows one rank receives."""

    tokens: int = 0
    scored_tokens: int = 0
    attention_pairs: int = 0

    def __add__(self, other: BatchWork) -> BatchWork:
        return BatchWork(
            self.tokens + other.tokens,
            self.scored_tokens + other.scored_tokens,
            self.attention_pairs + other.attention_pairs,
        )


def causal_pairs(length: int, prefix: int = 0) -> int:
    """(query, key) pairs of a causal segment of `length` tokens that also reads `prefix` earlier tokens.

    Example: `causal_pairs(3) == 6` (1 + 2 + 3); `causal_pairs(2, prefix=4) == 11` (2 x 4 + 1 + 2).
    """
    return length * prefix + length * (length + 1) // 2


def packed_row_work(segments: Iterable[Segment | int], scored_tokens: int, row_tokens: int | None = None) -> BatchWork:
    """The work of a packed row: each segment (a `Segment`, or an int for a plain causal sequence) attends within
    itself (and its prefix); `row_tokens` (default: the segments' tokens) counts a trailing padding segment too."""
    segments = [Segment(segment) if isinstance(segment, int) else segment for segment in segments]
    segment_tokens = sum(segment.length for segment in segments)
    return BatchWork(
        tokens=segment_tokens if row_tokens is None else row_tokens,
        scored_tokens=scored_tokens,
        attention_pairs=sum(causal_pairs(segment.length, segment.prefix) for segment in segments),
    )


def padded_batch_work(
    sequence_lengths: Sequence[int], scored_tokens: int, padded_length: int | None = None
) -> BatchWork:
    """The work of a padded batch: every sequence padded to `padded_length` (default: the longest), the linear layers
    on every padded token, attention on the full padded square of each sequence (sdpa under a padding mask). A batch
    with no padding at all runs without a mask, as a causal kernel: its triangle."""
    padded_length = max(sequence_lengths) if padded_length is None else padded_length
    unpadded = all(length == padded_length for length in sequence_lengths)
    pairs_per_sequence = causal_pairs(padded_length) if unpadded else padded_length**2
    return BatchWork(
        tokens=len(sequence_lengths) * padded_length,
        scored_tokens=scored_tokens,
        attention_pairs=len(sequence_lengths) * pairs_per_sequence,
    )


def forward_flops(shape: DecoderShape, work: BatchWork) -> int:
    """FLOPs of one forward of `work` through a decoder of `shape`."""
    linear = shape.linear_params * work.tokens
    lm_head = shape.lm_head_params * work.scored_tokens
    # QK^T and PV: a head_dim-long multiply-add each, per pair and query head
    attention = 2 * shape.num_attention_heads * shape.head_dim * work.attention_pairs * shape.attention_layers
    return FLOPS_PER_MULTIPLY_ADD * (linear + lm_head + attention)


def training_step_flops(shape: DecoderShape, work: BatchWork, reference_forward: bool = True) -> int:
    """FLOPs of one DPO training step on `work`: the policy's forward and backward (3 forwards) and, unless the
    reference log-probs are precomputed, the reference's forward (1)."""
    forwards = POLICY_FORWARDS + (REFERENCE_FORWARDS if reference_forward else 0)
    return forwards * forward_flops(shape, work)


def flop_ideal_speedup(shape: DecoderShape, padded: BatchWork, packed: BatchWork) -> float:
    """The speedup a layout allows if a step's time is proportional to its FLOPs: padded FLOPs / packed FLOPs. (The
    step's constant factor cancels: the same 4 forwards in both.)"""
    return forward_flops(shape, padded) / forward_flops(shape, packed)
