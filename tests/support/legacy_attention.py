"""A causal LM that keeps its own attention code, as legacy transformers classes do: its attention layers run eager
attention written in, whatever `attn_implementation` says, so transformers refuses to switch it to another backend.

The tests of `packed_attn_implementation='auto'` use it instead of a real legacy class: transformers moves those
classes onto its attention functions one release at a time (GPT-J and CodeGen in 5.24, GPT-Neo not yet), and a test
must not change meaning when one moves. This module must not call transformers' attention registry: transformers
decides from a module's source whether its classes can switch backends.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward


class LegacyAttention(nn.Module):
    """Llama's attention, projections and all, with eager attention called directly."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.num_key_value_groups = attention.num_key_value_groups
        self.scaling = attention.scaling
        self.is_causal = True
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            attention.q_proj,
            attention.k_proj,
            attention.v_proj,
            attention.o_proj,
        )

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        output, weights = eager_attention_forward(self, query, key, value, attention_mask, scaling=self.scaling)
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


class LegacyLlamaForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` whose every layer runs `LegacyAttention`."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn = LegacyAttention(layer.self_attn)


def make_legacy_model(seed: int, vocab_size: int, **overrides) -> LegacyLlamaForCausalLM:
    from transformers import LlamaConfig

    from trl_padfree.tiny import TINY_CONFIGS

    config = LlamaConfig(
        vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2, **TINY_CONFIGS["llama"]
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LegacyLlamaForCausalLM(config)
