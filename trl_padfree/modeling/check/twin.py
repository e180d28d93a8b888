"""The tiny twin of a model: the same class, attention backend and layer pattern (`layer_types`, dense/MoE mix,
sliding, chunked and full layers), every width shrunk, windows and chunks shrunk below the check's sequence lengths, in
float64, with zero-initialised tensors given small random values so that a leak cannot hide behind them. The
architecture check (packability.py) measures it; how it is built lives here.

With `real_head_dims`, the twin keeps the real model's head dims (`head_dim`, per-layer overrides such as Gemma 4's
512-wide global layers, multi-head latent attention's query, rope and value dims) and widens its hidden size to fit
them: the kernel coverage (kernel_coverage.py) plans each layer at the dims training will hand the kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import torch
from transformers import CONFIG_MAPPING, PretrainedConfig, PreTrainedModel

from ...integrations.transformers import attn_implementation as running_attention
from ...integrations.transformers import (
    set_config_implementations,
    set_language_model_attention,
    without_deepspeed_zero3,
)
from ..families import image_family
from ..packed_forward import add_packed_forward
from .family_twins import remap_special_tokens, twin_geometry

TWIN_SLIDING_WINDOW = 3
TWIN_CHUNK_SIZE = 4
TWIN_VOCAB_SIZE = 64
# Float64 puts rounding far below any leak (float32 noise on a deep twin reached 3e-5); MoE experts then run
# transformers' eager expert loop, the same per-token math as its grouped-GEMM kernels, which take no float64
TWIN_DTYPE = torch.float64

# Config fields shrunk on the twin, by name as transformers' configs spell them. Layer counts and per-layer lists
# are kept, so the twin has the real model's layer pattern.
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim", "embedding_dim")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "n_kv_heads")
_SHRUNK = {
    # widths
    "head_dim": 8,
    "intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "ffn_hidden_size": 64,
    "n_inner": 64,
    "ffn_dim": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    # multi-head latent attention (DeepSeek-V2/V3 and kin)
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    # the check's sequences must cross windows and chunks
    "sliding_window": TWIN_SLIDING_WINDOW,
    "attention_chunk_size": TWIN_CHUNK_SIZE,
    "hidden_size_per_layer_input": 8,  # Gemma 3n/4 per-layer inputs
    "rotary_dim": 4,  # partial rotary (GPT-J, CodeGen): at most the twin's head_dim
    "shared_intermediate_size": 32,
    # state-space and linear-attention mixers of hybrid models: a 32-wide twin expands to 64 inner channels
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "mamba_d_ssm": 64,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "mamba_chunk_size": 8,  # scans run in chunks: the check's sequences cross them
    "chunk_size": 8,  # (the Mamba2 mixers of Nemotron-H and Zamba2 call theirs chunk_size)
    "n_mamba_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "block_size": 8,  # lightning attention blocks (MiniMax)
    "linear_head_dim": 8,  # Kimi Linear's KDA, Bailing's linear attention
    "mamba_dt_rank": 8,
    "lru_width": 32,  # RecurrentGemma's recurrent block
    "attention_window_size": TWIN_SLIDING_WINDOW,
}
# The fields that set an attention layer's head dims, kept with `real_head_dims`
HEAD_DIM_FIELDS = ("head_dim", "global_head_dim", "swa_head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
# Mamba mixers whose heads must fill `expand` times the hidden size: (expand, heads, head dim) as configs name them
_MAMBA_WIDTHS = (
    ("mamba_expand", "mamba_n_heads", "mamba_d_head"),
    ("expand", "mamba_num_heads", "mamba_head_dim"),
    ("mamba_expand", "n_mamba_heads", "mamba_headdim"),  # Zamba2
)
# Query heads of a twin: its hidden size is this many real head dims when it keeps them
TWIN_HEADS = 4
# The usual initialisation scale, set on every twin whatever the real config says, so every check measures alike
TWIN_INITIALIZER_RANGE = 0.02
_AT_MOST = {  # expert counts: a few experts keep routing real without the size
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    # Mamba2 groups must divide the twin's 4 Mamba heads
    "n_groups": 2,
    "mamba_n_groups": 2,
    "mamba_ngroups": 2,
}


def _is_randomness(name: str) -> bool:
    """Config fields of randomness in training mode, where the check runs too: every dropout probability (configs
    spell them `attention_dropout`, `residual_dropout`, `hidden_dropout_prob`, `resid_pdrop`, `layerdrop`...), stochastic
    depth, and router jitter. Zeroed on the twin: a random mask differs between the packed and the separate runs."""
    return "dropout" in name or "jitter" in name or name.endswith(("pdrop", "layerdrop")) or name == "drop_path_rate"


# Derived on the real config from fields shrunk above (Zamba2 derives its attention widths): recomputed by the config
# class from the shrunk values. Dropped only where they are not fields of the config class (RWKV's, JetMoE's are).
_DERIVED = ("qk_head_dim", "attention_hidden_size", "attention_head_dim", "kv_channels", "num_query_groups")


class TwinError(ValueError):
    """The tiny twin of a model could not be built or run."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def real_head_dim(values: dict) -> int | None:
    """A config's attention head dim: its `head_dim`, else its hidden size over its heads."""
    if _is_int(values.get("head_dim")):
        return values["head_dim"]
    hidden = next((values[name] for name in _HIDDEN if _is_int(values.get(name))), None)
    heads = next((values[name] for name in _HEADS if _is_int(values.get(name))), None)
    return hidden // heads if hidden and heads else None


def _shrink(values: dict, real_head_dims: bool = False) -> dict:
    shrunk = dict(values)
    heads = next((shrunk[name] for name in _HEADS if isinstance(shrunk.get(name), int)), None)
    real = real_head_dim(values) if real_head_dims else None
    for name in _HEADS:
        if isinstance(shrunk.get(name), int):
            shrunk[name] = TWIN_HEADS
    for name in _KV_HEADS:
        kv_heads = shrunk.get(name)
        if isinstance(kv_heads, int) and heads:
            # Keep the kind of attention: multi-query, grouped-query or multi-head
            shrunk[name] = 1 if kv_heads == 1 else (2 if kv_heads < heads else 4)
    head_dim = shrunk["head_dim"] if isinstance(shrunk.get("head_dim"), int) else None
    for name in _HIDDEN:
        if isinstance(shrunk.get(name), int):
            if real is not None:  # as wide as the twin's heads at the real head dim, which models derive it from
                shrunk[name] = TWIN_HEADS * real
            else:
                shrunk[name] = 32 if head_dim is None else TWIN_HEADS * _SHRUNK["head_dim"]
    kept = HEAD_DIM_FIELDS if real_head_dims else ()
    for name, size in _SHRUNK.items():
        if isinstance(shrunk.get(name), int) and not isinstance(shrunk.get(name), bool) and name not in kept:
            shrunk[name] = size
    if real is not None:  # a Mamba mixer's heads fill its expanded width: kept so at the wider hidden size
        for expand, mixer_heads, mixer_head_dim in _MAMBA_WIDTHS:
            widths = [shrunk.get(name) for name in (expand, mixer_heads, mixer_head_dim)]
            hidden = next((shrunk[name] for name in _HIDDEN if _is_int(shrunk.get(name))), None)
            if all(_is_int(width) for width in widths) and hidden:
                # (Falcon-H1 names its mixer's width itself, `mamba_d_ssm`)
                width = shrunk["mamba_d_ssm"] if _is_int(shrunk.get("mamba_d_ssm")) else widths[0] * hidden
                shrunk[mixer_head_dim] = width // widths[1]
    for name, most in _AT_MOST.items():
        if isinstance(shrunk.get(name), int) and not isinstance(shrunk.get(name), bool):
            shrunk[name] = min(shrunk[name], most)
    for name in shrunk:
        if name.endswith("vocab_size") or name.startswith("vocab_size"):  # vocab_size, vocab_size_per_layer_input...
            if isinstance(shrunk[name], int):
                shrunk[name] = TWIN_VOCAB_SIZE
    if isinstance(shrunk.get("qk_rope_head_dim"), int) and not real_head_dims:
        shrunk["head_dim"] = shrunk["qk_rope_head_dim"]  # multi-head latent attention rotates only this part
    if isinstance(shrunk.get("initializer_range"), float):
        shrunk["initializer_range"] = TWIN_INITIALIZER_RANGE
    for name, value in list(shrunk.items()):
        if isinstance(value, float) and _is_randomness(name):
            shrunk[name] = 0.0
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if shrunk.get(name) is not None:
            shrunk[name] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name]
    return shrunk


def _shrink_override(override: dict, head_dim: int | None, real_head_dims: bool = False) -> dict:
    # Per-layer overrides (Gemma 4's wider full-attention heads): shrunk, keeping their ratio to the base head_dim,
    # or their own head dim with `real_head_dims`
    shrunk = _shrink(override, real_head_dims)
    if real_head_dims:
        shrunk.update({name: override[name] for name in HEAD_DIM_FIELDS if name in override})
    elif isinstance(override.get("head_dim"), int) and isinstance(head_dim, int) and head_dim > 0:
        shrunk["head_dim"] = max(1, override["head_dim"] // head_dim) * _SHRUNK["head_dim"]
    return shrunk


def _without_derived(values: dict, config_class: type | None) -> dict:
    declared = set()
    if dataclasses.is_dataclass(config_class):
        declared = {field.name for field in dataclasses.fields(config_class)}
    return {name: value for name, value in values.items() if name not in _DERIVED or name in declared}


def twin_config(config: PretrainedConfig, real_head_dims: bool = False) -> PretrainedConfig:
    """The config of the twin: every width shrunk, layer pattern kept, windows and chunks shorter than the check's
    sequences, no dropout; with `real_head_dims`, the real head dims kept (the hidden size widened to fit them).
    Sub-configs (a multimodal model's text and vision parts) and per-layer overrides are shrunk alike."""
    values = config.to_dict()
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:  # a sub-config
            shrunk = _shrink(value, real_head_dims)
            for name, layers in value.items():  # its own per-layer overrides (Gemma 4's text config in Gemma 4)
                if isinstance(layers, dict) and layers and all(isinstance(v, dict) for v in layers.values()):
                    head_dim = value.get("head_dim")
                    shrunk[name] = {
                        layer: _shrink_override(v, head_dim, real_head_dims) for layer, v in layers.items()
                    }
            values[key] = _without_derived(shrunk, CONFIG_MAPPING.get(value["model_type"]))
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            head_dim = values.get("head_dim")
            values[key] = {layer: _shrink_override(v, head_dim, real_head_dims) for layer, v in value.items()}
    values = _without_derived(_shrink(values, real_head_dims), type(config))
    if image_family(config.model_type) is not None:  # small images, image features as wide as the language model
        twin_geometry(config.model_type, values, real_head_dims)
        remap_special_tokens(values, TWIN_VOCAB_SIZE)
    values.pop("dtype", None)
    values.pop("_name_or_path", None)
    twin = type(config).from_dict(values)
    set_config_implementations(twin, running_attention(config))
    return twin


def architecture_signature(
    model_class: type, config: PretrainedConfig, attn_implementation: str, real_head_dims: bool = False
) -> str:
    """What a verdict depends on: the class, the attention backend and the twin's config."""
    values = twin_config(config, real_head_dims).to_dict()
    for key in ("transformers_version", "architectures", "dtype", "_name_or_path", "_attn_implementation_autoset"):
        values.pop(key, None)
    name = f"{model_class.__module__}.{model_class.__qualname__}"
    return json.dumps([name, attn_implementation, values], sort_keys=True, default=str)


@contextlib.contextmanager
def one_thread():
    # A twin's matrices are 32 wide: threads only add synchronisation, which on a busy machine costs 10x
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def private_rng(seed: int = 0):
    # The twin's initialisation and random tokens must leave the training run's RNG streams untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# A twin is a few hundred thousand parameters; one far larger means a width field escaped the shrinking. One at the
# real head dims is wider (a hidden size of 4 heads of up to 512, in every layer of the real model)
MAX_TWIN_PARAMETERS = 20_000_000
MAX_WIDE_TWIN_PARAMETERS = 400_000_000


def _check_twin_size(model_class: type, config: PretrainedConfig, most: int) -> None:
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(config).parameters())
    if parameters > most:
        raise TwinError(
            f"the twin would have {parameters:,} parameters (at most {most:,}): some width of this config is not "
            "shrunk by trl_padfree.modeling.check.twin"
        )


def build_twin(
    model_class: type,
    config: PretrainedConfig,
    attn_implementation: str,
    real_head_dims: bool = False,
    dtype: torch.dtype = TWIN_DTYPE,
) -> PreTrainedModel:
    """A tiny instance of `model_class` on the CPU, in `dtype` (float64 for the architecture check), outside any
    ZeRO-3 context; with `real_head_dims`, at the real model's head dims (see module docstring)."""
    try:
        tiny = twin_config(config, real_head_dims)
        set_config_implementations(tiny, "eager", experts_implementation="eager")
        # Built whole under ZeRO-3 too: each process checks its own twin, and a composite class would otherwise
        # partition its parts (it builds them with `from_config`), in collectives the other processes never join
        with private_rng(), without_deepspeed_zero3():
            _check_twin_size(model_class, tiny, MAX_WIDE_TWIN_PARAMETERS if real_head_dims else MAX_TWIN_PARAMETERS)
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                twin = model_class(tiny)
            finally:
                torch.set_default_dtype(default_dtype)
            twin = twin.to(dtype).eval()
            for parameter in twin.parameters():
                if not parameter.detach().any():  # a zero tensor hides a leak: a gate at 0 passes nothing on
                    parameter.data.normal_(0.0, TWIN_INITIALIZER_RANGE)
        set_language_model_attention(twin, attn_implementation)
        add_packed_forward(twin)  # as the trainer's models get it, stateful mixers included (mixers.py)
    except Exception as error:  # any failure here is the twin's, reported with what failed
        raise TwinError(f"{type(error).__name__}: {error}") from error
    return twin
