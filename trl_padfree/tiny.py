"""Tiny models built locally from a config, with no download.

The demo models (`trl-padfree/<size>-<model_type>`, over the shipped tokenizer) are what the demo, the benchmarks, the
memory planner and the recipes run on; the tests build theirs from the same `TINY_CONFIGS` and `make_model`
(tests/support/tiny_fixtures.py).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .data import load_demo_tokenizer

# One config per demo model type: small enough for a CPU forward in milliseconds, yet with GQA, rotary, sliding
# windows and learned absolute positions where the architecture has them
_DECODER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
_SLIDING = dict(sliding_window=6)  # shorter than several test sequences, so the window really cuts
TINY_CONFIGS = {
    "llama": _DECODER,
    "qwen2": _DECODER,
    "qwen3": {**_DECODER, "head_dim": 8},
    "mistral": {**_DECODER, **_SLIDING},
    "gemma3_text": {**_DECODER, **_SLIDING, "head_dim": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": _DECODER,
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=512),
}


def make_model(
    model_type: str = "llama",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
    **overrides,
):
    """A randomly initialised tiny causal LM of `model_type`, the same weights for the same seed, over `vocab_size`
    tokens (default: the shipped tokenizer's, `trl_padfree.data`) with pad, bos and eos ids 0, 1 and 2."""
    if vocab_size is None:
        vocab_size = len(load_demo_tokenizer())
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **{**TINY_CONFIGS.get(model_type, {}), **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    model.config.name_or_path = f"tiny-{model_type}"
    return model


# Demo models: these architectures at a few sizes, over the shipped tokenizer's vocabulary. Recipes and the CLI
# name them `trl-padfree/<size>-<model_type>` (e.g. `trl-padfree/tiny-llama`); they are built and saved locally.
DEMO_MODEL_PREFIX = "trl-padfree/"
DEMO_MODEL_SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "small": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4),
    "base": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8),
}
_GPT2_NAMES = dict(hidden_size="n_embd", num_hidden_layers="n_layer", num_attention_heads="n_head")


def demo_model_config(size: str, model_type: str) -> dict:
    """Config overrides of a demo model: the size's shape with GQA where the architecture has it, in its own names."""
    if size not in DEMO_MODEL_SIZES:
        raise ValueError(f"Unknown demo model size {size!r}; choose one of {sorted(DEMO_MODEL_SIZES)}.")
    shape = dict(DEMO_MODEL_SIZES[size])
    if model_type == "gpt2":
        del shape["intermediate_size"]
        return {_GPT2_NAMES[key]: value for key, value in shape.items()} | {"n_positions": 2048}
    if model_type != "gpt_neox":
        shape["num_key_value_heads"] = shape["num_attention_heads"] // 2
    if model_type in ("qwen3", "gemma3_text"):
        shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    if model_type in ("mistral", "gemma3_text"):
        shape["sliding_window"] = 256  # shorter than the long shipped pairs, so the window really acts
    return shape


def make_demo_model(size: str = "tiny", model_type: str = "llama", attn_implementation: str = "sdpa", seed: int = 0):
    """A randomly initialised demo model over the shipped tokenizer's vocabulary (`trl_padfree.data`)."""
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"Unknown demo model type {model_type!r}; choose one of {sorted(TINY_CONFIGS)}.")
    overrides = {**TINY_CONFIGS[model_type], **demo_model_config(size, model_type)}
    model = make_model(model_type, attn_implementation, seed, **overrides)
    model.config.name_or_path = f"{DEMO_MODEL_PREFIX}{size}-{model_type}"
    return model


def is_demo_model_name(name: str) -> bool:
    return name.startswith(DEMO_MODEL_PREFIX)


def parse_demo_model_name(name: str) -> tuple[str, str]:
    """`"trl-padfree/tiny-llama"` -> `("tiny", "llama")`, with an error naming the valid choices."""
    size, _, model_type = name.removeprefix(DEMO_MODEL_PREFIX).partition("-")
    if size not in DEMO_MODEL_SIZES or model_type not in TINY_CONFIGS:
        raise ValueError(
            f"Unknown demo model {name!r}: expected {DEMO_MODEL_PREFIX}<size>-<type> with size in "
            f"{sorted(DEMO_MODEL_SIZES)}, type in {sorted(TINY_CONFIGS)}."
        )
    return size, model_type
