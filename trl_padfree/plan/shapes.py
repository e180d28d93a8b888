"""Model shape: what the planner needs of a model, from a parameter count, a config or a demo model name.

Nothing is loaded but the model's config: the parameters are counted on a model built on the meta device.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from ..integrations.transformers import no_split_modules
from ..modeling.vision import is_vision_language
from ..sources import load_model_config
from ..tiny import is_demo_model_name, make_demo_model, parse_demo_model_name
from .units import parse_count


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: its parameter counts, and the layer shape the activation estimate reads."""

    name: str
    total_params: int
    largest_layer_params: int | None  # the biggest module's own parameters: ZeRO-3 gathers one such at a time
    num_layers: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    q_dim: int | None = None  # attention heads x head dim
    kv_dim: int | None = None  # key-value heads x head dim
    vocab_size: int | None = None
    gated_mlp: bool = True  # SwiGLU-style gate and up projections (Llama, Qwen, Mistral), else one (GPT-2, NeoX)
    mixture_of_experts: bool = False
    # FSDP2's units (accelerate's TRANSFORMER_BASED_WRAP: one per module named in the model's `_no_split_modules`)
    decoder_layer_params: int | None = None  # the largest such unit: FSDP2 gathers one or two at a time
    non_layer_params: int | None = None  # everything outside them: embeddings, final norm, LM head
    input_embedding_params: int | None = None
    tied_embeddings: bool = False  # the LM head is the input embedding's weight
    # A vision-language model's vision tower: its blocks and width, and the patches it encodes per image token (a
    # Qwen-VL merges 2 x 2 patches into one); None for a text model
    vision_layers: int | None = None
    vision_hidden_size: int | None = None
    vision_intermediate_size: int | None = None
    vision_patches_per_token: int = 1

    @property
    def no_activations_reason(self) -> str | None:
        """Why the activations cannot be estimated, or None when they can."""
        if self.num_layers is None:
            return "a parameter count has no layer shape: give a config to estimate them"
        if self.mixture_of_experts:
            return "mixture of experts is not modelled"
        return None


def load_model_shape(model: str, largest_layer_params: int | None = None) -> ModelShape:
    """The shape of `model`: a parameter count, `trl-padfree/<size>-<type>`, a local folder or config.json, or a hub
    name (its config.json only, which needs network access once)."""
    count = None
    if not os.path.exists(model):
        with contextlib.suppress(ValueError):
            count = parse_count(model)
    if count is not None:
        return ModelShape(model, count, largest_layer_params)
    if largest_layer_params is not None:
        raise ValueError("--largest-layer goes with a parameter count; with a config the planner counts it itself.")
    if is_demo_model_name(model):
        with torch.device("meta"):
            return shape_of_model(model, make_demo_model(*parse_demo_model_name(model)))
    return shape_of_config(model, load_model_config(model, what="parameter count, model folder or config.json"))


def shape_of_config(name: str, config) -> ModelShape:
    """Count the parameters of `config`'s causal LM (a vision-language model's image-text-to-text model, vision tower
    included) exactly, built on the meta device: no memory, no weights."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_class = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = auto_class.from_config(config)
    except ValueError as error:
        raise ValueError(f"{name}: cannot build a causal LM from its config ({error}).") from error
    return shape_of_model(name, model)


def shape_of_model(name: str, model: torch.nn.Module) -> ModelShape:
    # DeepSpeed's `model_to_params` does the same count, but tells shared parameters apart by `data_ptr()`, which is 0
    # for every tensor on the meta device; `parameters()` already yields a tied weight once
    total_params = sum(parameter.numel() for parameter in model.parameters())
    largest_layer_params = max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())
    config = model.config.get_text_config()
    hidden_size = config.hidden_size
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden_size // num_heads
    num_experts = max(
        getattr(config, key, None) or 0 for key in ("num_experts", "num_local_experts", "n_routed_experts")
    )
    layers = next((module for module in model.modules() if isinstance(module, torch.nn.ModuleList)), [])
    mlp = getattr(layers[0], "mlp", None) if len(layers) else None
    layer_units = [sum(p.numel() for p in unit.parameters()) for unit in fsdp_layer_units(model)]
    input_embedding, output_embedding = model.get_input_embeddings(), model.get_output_embeddings()
    vision = getattr(model.config, "vision_config", None)
    return ModelShape(
        name=name,
        total_params=total_params,
        largest_layer_params=largest_layer_params,
        num_layers=config.num_hidden_layers,
        hidden_size=hidden_size,
        intermediate_size=getattr(config, "intermediate_size", None)
        or getattr(config, "n_inner", None)
        or 4 * hidden_size,
        q_dim=num_heads * head_dim,
        kv_dim=(getattr(config, "num_key_value_heads", None) or num_heads) * head_dim,
        vocab_size=config.vocab_size,
        gated_mlp=mlp is not None and any("gate" in child for child, _ in mlp.named_modules()),
        mixture_of_experts=num_experts > 0,
        decoder_layer_params=max(layer_units, default=None),
        non_layer_params=total_params - sum(layer_units) if layer_units else None,
        input_embedding_params=sum(p.numel() for p in input_embedding.parameters()),
        tied_embeddings=output_embedding is not None and output_embedding.weight is input_embedding.weight,
        **(_vision_shape(vision) if vision is not None else {}),
    )


def _vision_shape(vision) -> dict:
    """A vision tower's blocks, width and patches per image token, read from its config (the names differ by family:
    `depth` or `num_hidden_layers`, `embed_dim` or `hidden_size`, Qwen-VL's `spatial_merge_size`)."""
    hidden = getattr(vision, "embed_dim", None) or vision.hidden_size
    intermediate = getattr(vision, "intermediate_size", None) or int(getattr(vision, "mlp_ratio", 4) * hidden)
    merge = getattr(vision, "spatial_merge_size", None) or 1
    return dict(
        vision_layers=getattr(vision, "depth", None) or vision.num_hidden_layers,
        vision_hidden_size=hidden,
        vision_intermediate_size=intermediate,
        vision_patches_per_token=merge**2,
    )


def fsdp_layer_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules accelerate's TRANSFORMER_BASED_WRAP gives an FSDP unit each: those whose class the model names in
    `_no_split_modules` (the decoder layers, and a vision tower's blocks where there is one)."""
    wrapped = set(no_split_modules(model))
    return [module for module in model.modules() if type(module).__name__ in wrapped]
