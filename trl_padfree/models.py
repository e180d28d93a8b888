"""Which models and attention implementations may run packed rows, and the check for the others."""

from __future__ import annotations

import torch

from .attention import ATTN_IMPLEMENTATION, shared_prefix_expected
from .packing import cu_seq_lens_from_lengths, position_ids_from_lengths

# Packed forward equal to per-sequence forwards on every backend below: tests/test_models.py checks each pair
VERIFIED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "gpt_neox", "gpt2")

# Known to be wrong when packed, whatever the backend
BROKEN_MODEL_TYPES = {
    "opt": "OPT's sdpa/eager masks ignore packed position_ids, so packed sequences attend to each other",
    "falcon": "Falcon's attention ignores the packed position_ids (ALiBi or mask-derived positions)",
    "bloom": "Bloom's ALiBi bias is built from the attention mask, so packed sequences see each other",
    "mpt": "MPT's ALiBi bias ignores position_ids",
    "gemma2": "Gemma2 softcaps attention logits, which only eager supports, and eager packing is not verified",
}

# Backends that keep packed sequences apart: ours, flash varlen (cu_seq_lens), and the block-diagonal mask that
# sdpa/eager build from position_ids when no attention mask is passed
FLASH_VARLEN = ("flash_attention_2", "flash_attention_3")
PACKING_AWARE_ATTENTION = (ATTN_IMPLEMENTATION, *FLASH_VARLEN, "sdpa", "eager")

# Largest max-abs difference of log-probs the self-check accepts. Fp32 noise is ~1e-6; a leak on tiny random models
# measured 5e-3 (ALiBi) to 0.5, which half-precision rounding can hide, so only fp32/fp64 models are self-checked
SELF_CHECK_TOLERANCE = 1e-4


def resolve_attn_implementation(requested: str, current: str | None, prefix_sharing: bool = False) -> str:
    """`auto` keeps a flash varlen kernel the model already uses, else picks `padfree_varlen`; `keep` keeps `current`.

    Prefix sharing needs `padfree_varlen`, the one attention that reads the shared layout: `auto` picks it always.
    """
    if requested == "auto":
        return current if current in FLASH_VARLEN and not prefix_sharing else ATTN_IMPLEMENTATION
    resolved = current if requested == "keep" else requested
    if prefix_sharing and resolved != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"prefix_sharing=True needs the `{ATTN_IMPLEMENTATION}` attention (PyTorch's varlen kernel on CUDA, exact "
            f"per-segment attention on CPU), which lets rejected tokens attend to their prompt; {resolved!r} would "
            f"treat each rejected branch as a sequence of its own. Set packed_attn_implementation='auto' (or "
            f"'{ATTN_IMPLEMENTATION}'), or prefix_sharing=False."
        )
    return resolved


def check_attn_implementation(attn_implementation: str | None) -> None:
    if attn_implementation not in PACKING_AWARE_ATTENTION:
        raise ValueError(
            f"padding_free=True cannot run with attn_implementation={attn_implementation!r}: it is not known to keep "
            f"packed sequences apart. Use one of {list(PACKING_AWARE_ATTENTION)} (set `packed_attn_implementation`), "
            "or padding_free=False."
        )


def _is_partitioned(model: torch.nn.Module) -> bool:
    # ZeRO-3 parameters are empty placeholders until DeepSpeed gathers them
    return any(hasattr(parameter, "ds_id") for parameter in model.parameters())


@torch.no_grad()
def packed_forward_error(model: torch.nn.Module, lengths: tuple[int, ...] = (7, 2, 12)) -> float:
    """Max abs difference of log-probs between one packed forward and per-sequence forwards of random tokens."""
    vocab_size = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)  # a private generator leaves the training RNG untouched
    device = next(model.parameters()).device
    sequences = [torch.randint(vocab_size, (1, length), generator=generator).to(device) for length in lengths]
    cu_seq_lens = cu_seq_lens_from_lengths(lengths).to(device)
    packed_kwargs = {
        "input_ids": torch.cat(sequences, dim=1),
        "position_ids": position_ids_from_lengths(lengths).to(device),
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "use_cache": False,
    }
    was_training = model.training
    model.eval()
    try:
        packed = model(**packed_kwargs).logits.float().log_softmax(-1)[0]
        separate = torch.cat(
            [model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)[0] for ids in sequences]
        )
    finally:
        model.train(was_training)
    return (packed - separate).abs().max().item()


@torch.no_grad()
def shared_forward_error(model: torch.nn.Module, shapes=((6, 3, 4), (3, 5, 2))) -> float:
    """Max abs difference of log-probs between one prefix-sharing forward and per-sequence forwards of random pairs
    `(prompt, chosen, rejected)` token counts."""
    from .collator import concatenated_inputs
    from .forward import PackedBatch

    vocab_size = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> list[int]:
        return torch.randint(vocab_size, (count,), generator=generator).tolist()

    pairs = [{"prompt_ids": tokens(p), "chosen_ids": tokens(c), "rejected_ids": tokens(r)} for p, c, r in shapes]
    device = next(model.parameters()).device
    batch = concatenated_inputs(pairs, prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)
    batch = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    packed = PackedBatch.from_collated(batch)
    sequences = [pair["prompt_ids"] + pair[key] for key in ("chosen_ids", "rejected_ids") for pair in pairs]
    was_training = model.training
    model.eval()
    try:
        with shared_prefix_expected(packed.shared_prefix):
            logits = model(**packed.model_kwargs()).logits.float().log_softmax(-1)
        shared = packed.padded(logits)[packed.token_valid]
        separate = torch.cat(
            [
                model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits.float().log_softmax(-1)[0]
                for ids in sequences
            ]
        )
    finally:
        model.train(was_training)
    return (shared - separate).abs().max().item()


def check_packable(model: torch.nn.Module, prefix_sharing: bool = False) -> None:
    """Refuse a model whose packed forward would differ from its per-sequence forward.

    Verified model types pass; known-broken ones raise; any other model is checked once on three random sequences and
    refused unless the packed forward matches (it cannot be checked while ZeRO-3 holds the parameters partitioned).
    With `prefix_sharing`, it is checked on a prefix-sharing row of two random pairs as well.
    """
    model_type = model.config.get_text_config().model_type
    attn_implementation = model.config._attn_implementation
    check_attn_implementation(attn_implementation)
    if model_type in BROKEN_MODEL_TYPES:
        raise ValueError(
            f"padding_free=True is not supported for model type {model_type!r}: {BROKEN_MODEL_TYPES[model_type]}. "
            "Train it with padding_free=False."
        )
    if model_type in VERIFIED_MODEL_TYPES:
        return
    if _is_partitioned(model):
        raise ValueError(
            f"Model type {model_type!r} is not among the verified packable models {list(VERIFIED_MODEL_TYPES)}, and "
            "its packed forward cannot be self-checked while ZeRO-3 partitions its parameters. Train it with "
            "padding_free=False, or check it once without ZeRO-3 with `trl_padfree.models.packed_forward_error`."
        )
    if model.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"Model type {model_type!r} is not among the verified packable models {list(VERIFIED_MODEL_TYPES)}, and "
            f"its {model.dtype} weights are too coarse for the packing self-check to tell a leak from rounding. Load "
            "it in float32 (e.g. `model_init_kwargs={'dtype': 'float32'}` with `bf16=True` autocast) so it can be "
            "checked, or train it with padding_free=False."
        )
    error = packed_forward_error(model)
    if not error <= SELF_CHECK_TOLERANCE:
        raise ValueError(
            f"Model type {model_type!r} with attn_implementation={attn_implementation!r} is not packable: its packed "
            f"forward differs from per-sequence forwards by {error:.3g} (tolerance {SELF_CHECK_TOLERANCE:g}), so "
            "packed sequences would see each other. Train it with padding_free=False."
        )
    if prefix_sharing:
        error = shared_forward_error(model)
        if not error <= SELF_CHECK_TOLERANCE:
            raise ValueError(
                f"Model type {model_type!r} cannot share prefixes: its prefix-sharing forward differs from "
                f"per-sequence forwards by {error:.3g} (tolerance {SELF_CHECK_TOLERANCE:g}), e.g. because some layers "
                "mix tokens outside the attention interface. Set prefix_sharing=False."
            )
