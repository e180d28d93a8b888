"""Tiny models of today's architectures, from their default configs: MoE routers, sliding, full and chunked layers,
attention sinks and per-layer inputs kept, every width shrunk.

`trl_padfree.modeling.check.twin.twin_config` shrinks a config the way the packability check does (widths, heads, experts,
windows of 3 tokens and chunks of 4); here the layer count is cut to one period of the model's layer pattern and the
vocabulary set to the tokenizer's:

    model type    layers  kinds kept
    qwen3_moe     2       dense MLP (mlp_only_layers=[0]), MoE
    mixtral       2       MoE
    deepseek_v3   2       dense (first_k_dense_replace=1), MoE with group routing and a shared expert
    glm4_moe      2       dense (first_k_dense_replace=1), MoE with a shared expert
    gemma4_text   6       5 sliding + 1 full, per-layer inputs, tied embeddings
    gpt_oss       2       sliding + full, MoE with biases, attention sinks
    llama4_text   4       3 chunked (RoPE) + 1 full (no RoPE), MoE with a shared expert, dense MLP (step 2)
    olmo3         4       3 sliding + 1 full

Parameters that the model initialises to zero (gpt_oss's sinks, router and expert biases) get small random values, so
that a difference between packed and padded training cannot hide behind a zero.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from tiny_fixtures import VOCAB_SIZE
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from trl_padfree.modeling.check.twin import twin_config

INITIALIZER_RANGE = 0.02
TINY_LAYERS = {
    "qwen3_moe": dict(num_hidden_layers=2, mlp_only_layers=[0]),
    "mixtral": dict(num_hidden_layers=2),
    "deepseek_v3": dict(num_hidden_layers=2, first_k_dense_replace=1),
    "glm4_moe": dict(num_hidden_layers=2, first_k_dense_replace=1),
    "gemma4_text": dict(num_hidden_layers=6),
    "gpt_oss": dict(num_hidden_layers=2),
    "llama4_text": dict(num_hidden_layers=4, interleave_moe_layer_step=2),
    "olmo3": dict(num_hidden_layers=4),
    "gemma3_text": dict(num_hidden_layers=6),  # 5 sliding + 1 full
    "cohere2": dict(num_hidden_layers=4),  # 3 sliding + 1 full
    "smollm3": dict(num_hidden_layers=4),  # 3 RoPE + 1 NoPE
    # Hybrids: linear-attention or state-space layers around attention layers, the real checkpoints' kinds of layer
    "qwen3_5_text": dict(num_hidden_layers=4),  # 3 gated delta rule + 1 full attention
    "qwen3_5_moe_text": dict(num_hidden_layers=4),
    "qwen3_next": dict(num_hidden_layers=4),
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"]),  # LFM2-350M's start
    "lfm2_moe": dict(num_hidden_layers=4, num_dense_layers=1, layer_types=["conv", "full_attention", "conv", "conv"]),
    "nemotron_h": dict(num_hidden_layers=4),  # Mamba2, MoE, attention, MLP
    "falcon_h1": dict(num_hidden_layers=2),  # attention and Mamba2 side by side in every layer
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[2]),
    "zamba2": dict(
        num_hidden_layers=4, layers_block_type=["linear_attention", "linear_attention", "hybrid", "linear_attention"]
    ),
    "granitemoehybrid": dict(
        num_hidden_layers=4, layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    ),
}
DEFAULT_LAYERS = dict(num_hidden_layers=2)  # every other type: two layers of its one kind
HYBRID_MODEL_TYPES = (
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "lfm2",
    "lfm2_moe",
    "nemotron_h",
    "falcon_h1",
    "bamba",
    "zamba2",
    "granitemoehybrid",
)
# Per-layer lists of the default config, cut to the tiny layer count; llama4's `moe_layers` is recomputed instead
_PER_LAYER_LISTS = ("layer_types", "no_rope_layers")


def tiny_config(model_type: str, vocab_size: int, real_head_dims: bool = False, **overrides) -> PretrainedConfig:
    """The default config of `model_type`, shrunk like the packability twin (with `real_head_dims`, at the default
    config's head dims), with `TINY_LAYERS` layers (two by default)."""
    values = twin_config(AutoConfig.for_model(model_type), real_head_dims).to_dict()
    layers = {**TINY_LAYERS.get(model_type, DEFAULT_LAYERS), **overrides}
    count = layers["num_hidden_layers"]
    for name in _PER_LAYER_LISTS:
        if isinstance(values.get(name), list):
            values[name] = values[name][:count]
    for name in ("moe_layers", "hybrid_layer_ids"):  # derived from the layer pattern by the config class
        values.pop(name, None)
    if isinstance(values.get("per_layer_config"), dict):
        # Gemma 4's full-attention layers have wider heads (512 by default): keep them wider than the sliding ones
        values["per_layer_config"] = {
            key: {
                name: 2 * values["head_dim"] if name == "head_dim" and not real_head_dims else value
                for name, value in layer.items()
            }
            for key, layer in values["per_layer_config"].items()
            if int(key) < count
        }
    for name in list(values):
        if (name.endswith("vocab_size") or name.startswith("vocab_size")) and isinstance(values[name], int):
            values[name] = vocab_size  # vocab_size, vocab_size_per_layer_input
    values.update(layers)
    values.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # both tokenizers' ids (trl_padfree.tiny, .data)
    for name in ("model_type", "transformers_version", "architectures", "_name_or_path"):
        values.pop(name, None)
    config = AutoConfig.for_model(model_type, **values)
    assert config.num_hidden_layers == count
    for name in _PER_LAYER_LISTS:
        assert getattr(config, name, None) is None or len(getattr(config, name)) == count, name
    return config


def make_tiny_model(
    model_type: str,
    vocab_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    real_head_dims: bool = False,
    **overrides,
):
    """A randomly initialised tiny model of `model_type`, the same weights for the same seed, no zero tensor. The
    attention defaults to transformers' choice for the class (sdpa, or eager where the class has no sdpa: gpt_oss).
    With `real_head_dims`, its attention layers have the default config's head dims (Gemma 4: 256 sliding, 512
    global; DeepSeek-V3: 192 query and key, 128 value)."""
    config = tiny_config(model_type, vocab_size, real_head_dims, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.any():
                parameter.normal_(0.0, INITIALIZER_RANGE)
    model.config.name_or_path = f"tiny-{model_type}"
    return model.to(dtype)


def save_tiny_architecture(directory: Path, model_type: str, **overrides) -> Path:
    """A tiny model over the shipped tokenizer's vocabulary, saved in float32 with the tokenizer, for other processes."""
    from trl_padfree.data import load_demo_tokenizer

    tokenizer = load_demo_tokenizer()
    make_tiny_model(model_type, len(tokenizer), **overrides).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# The families users train, every one exact on padfree_varlen (docs/reference/models-table.md has them all)
POPULAR_TYPES = (
    "llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma3_text", "gemma4_text", "phi3", "deepseek_v3",
    "glm4_moe", "olmo3", "smollm3", "ministral3", "granite", "cohere2", "gpt_oss", "llama4_text", "gpt2", "gpt_neox",
)  # fmt: skip

# The attention projections' input: Gemma 4 and DeepSeek-V3 take their head dims from the config, not from the hidden
# size, and bf16 matmuls of a wide hidden size take a minute per step on CPUs without bf16 instructions
NARROW_HIDDEN = 64


def real_head_dims(model_type: str, attn_implementation: str | None = None):
    """A seeded factory of the tiny `model_type` at its default config's head dims, over the tests' vocabulary."""
    return lambda seed: make_tiny_model(
        model_type,
        VOCAB_SIZE,
        seed=seed,
        attn_implementation=attn_implementation,
        real_head_dims=True,
        hidden_size=NARROW_HIDDEN,
    )


def model_factory(model_type: str, **overrides):
    """A seeded factory of the tiny `model_type` over the tests' vocabulary, `overrides` going to its config."""
    return functools.partial(make_tiny_model, model_type, VOCAB_SIZE, **overrides)
