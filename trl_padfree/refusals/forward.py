"""Refusals of the packed forward and its attention calls: no cache, no padding mask, one packed row per call,
the row layout received and read, the stateful mixers' inputs."""

from __future__ import annotations

from .models import PADFREE_VARLEN

# ---- the packed forward and its attention ----


def check_no_cache(live_cache: bool) -> None:
    if live_cache:
        raise ValueError(
            "A packed forward cannot use a KV cache: with a cache, transformers ignores the packed position_ids and "
            "every sequence of the row attends to the ones before it. Call the model with `use_cache=False`."
        )


def check_no_padding_mask(padded: bool) -> None:
    """`padfree_varlen` honours no attention mask: a padded batch would let real tokens attend to padding."""
    if padded:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention got a padded batch (an attention mask with zeros), which it cannot honour. "
            "Pass packed rows without a mask, or switch the model back for padded inputs, e.g. "
            "`model.set_attn_implementation('sdpa')` before `generate`."
        )


def check_attention_call(
    has_mask: bool, rows: int, queries: int, keys: int, boundaries_known: bool, causal: bool, sinks: int | None, heads
) -> None:
    """One call of `padfree_varlen`: one packed row of causal self-attention, its boundaries known."""
    if has_mask:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention is for packed rows and takes no attention mask; this batch is padded. "
            "Use the padding-free collator, or `sdpa` for padded batches."
        )
    if not boundaries_known:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention needs `cu_seq_lens_q` or the `position_ids` of one packed row; pass the "
            "batch of `PaddingFreePreferenceCollator` to the model."
        )
    if rows != 1 or queries != keys:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention expects one packed row of self-attention (no cache); got {rows} rows, "
            f"{queries} queries and {keys} keys."
        )
    if sinks is not None and sinks != heads:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention needs one attention sink per query head: got {sinks} sinks for {heads} "
            "heads."
        )
    if not causal:
        raise ValueError(f"`{PADFREE_VARLEN}` attention only supports causal (decoder) self-attention.")


def check_chunked_layer(module_class: str, layer_idx: int | None, chunk_size: int | None) -> None:
    """A chunked attention layer (`layer_idx` None: the config has chunked layers, the module no index)."""
    if layer_idx is None:
        raise ValueError(
            f"`{PADFREE_VARLEN}` attention cannot tell whether this {module_class} is a chunked attention layer: its "
            "config has chunked layers but the module has no `layer_idx`."
        )
    if not chunk_size:
        raise ValueError(
            f"Layer {layer_idx} is a chunked attention layer, but its config sets no attention_chunk_size."
        )


def refuse_prefix_sharing_with_chunked_layers() -> None:
    # A rejected branch's chunks are counted from the start of its prompt, which its row segment does not hold
    raise ValueError("prefix sharing with chunked attention layers is not supported; set prefix_sharing=False.")


def refuse_image_spans_with_chunked_layers() -> None:
    raise ValueError(
        "A model with chunked attention layers cannot train padding-free on images that attend to themselves both "
        "ways (Gemma 3's): no such model exists in transformers, so the combination is not implemented. Set "
        "padding_free=False."
    )


def refuse_layout_not_received(layout: str, keyword: str, consequence: str, way_out: str) -> None:
    """An attention call during a forward whose row layout (prefix sharing, context parallelism) it did not get."""
    raise ValueError(
        f"This model's attention layers did not receive the {layout} (`{keyword}`), so {consequence}. Its model type "
        f"does not pass keyword arguments down to attention; set {way_out} for it."
    )


def refuse_layout_not_read(layout: str, consequence: str, way_out: str) -> None:
    """A forward whose row layout no attention call read: the model mixes tokens without the attention interface."""
    raise ValueError(
        f"No attention layer of this model read the {layout}, so {consequence}. The model does not run its attention "
        f"through `{PADFREE_VARLEN}` with transformers' keyword arguments; set {way_out}."
    )


def check_mixer_segments(mixer_class: str, packed_without_segments: bool) -> None:
    if packed_without_segments:
        raise ValueError(
            f"{mixer_class} got a packed row without its sequence boundaries: a packed forward of this model must go "
            "through trl_padfree's packed forward (`model(..., packed_batch=...)`)."
        )


def check_mixer_conv_width(mixer_class: str, width: int, refusing_kernel: tuple[str, str] | None) -> None:
    """`refusing_kernel`: (the resolved convolution kernel, its pip distribution) when it refuses this width."""
    if refusing_kernel is not None:
        kernel, distribution = refusing_kernel
        raise ValueError(
            f"{mixer_class} layers convolve over {width} tokens, and transformers hands them to {kernel}, which takes "
            f"widths 2 to 4 only: the model fails in transformers itself, padded or packed. Uninstall {distribution} "
            "(transformers then runs its PyTorch convolution)."
        )


def check_mixer_inputs(mixer_class: str, live_cache: bool, has_mask: bool) -> None:
    if live_cache:
        raise ValueError(f"{mixer_class}: a packed forward runs without a cache (use_cache=False).")
    if has_mask:
        raise ValueError(f"{mixer_class}: a packed row carries no attention mask; its boundaries are the segments.")
