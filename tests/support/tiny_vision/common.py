"""What every tiny vision-language family shares: the record that describes one, the tokenizer, the chat template and
the model sizes.

Each processor is built over the tokenizer trl_padfree ships (`trl_padfree.data.load_demo_tokenizer`) with the
family's special tokens added (ids from 2048), uses the PIL image processor transformers ships (no torchvision), tiny
images and a chat template `User:<image> text</s>Assistant: text</s>` whose image part is the processor's placeholder.
Models: text width 32, 2 layers, 4 heads, 2 KV heads, vocabulary = the tokenizer's, pad / bos / eos ids 0 / 1 / 2;
vision towers of width 32 and 2 layers; geometry read back from the processor. A padded TRL DPO step trains every
trainable parameter and, with policy == reference, starts at ln 2 (a router loss adds to it: Qwen3-VL-MoE's
0.6931 + 0.001 * aux_loss). Where the checkpoints would leave a parameter without gradients, a family's
`prepare_model` freezes it, or draws it where it starts at zero.

What TRL's `DataCollatorForVisionPreference` makes of 2 default rows: 4 sequences (the chosen, then the rejected),
each family with input_ids, attention_mask and completion_mask of shape (4, L), plus its image inputs (each layout
module's table). Completion padding may hold the eos id 2 rather than 0 (TRL pads with `pad_token_id or
eos_token_id`); the masks are 0 there. `config.image_token_id` reads the image token's id in every family
(`image_token_index` is aliased by the attribute_map of the configs that name it so).

Without torchvision there is no video processor: the processors of many families here are subclasses with
trl_padfree's `WithoutVideoProcessor`, which accept `video_processor=None`. They handle images and text only, and
their `save_pretrained` fails (AttributeError on the missing video processor); train with `save_strategy="no"`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

from trl_padfree.data import load_demo_tokenizer

# What the tests select families by (`TinyFamily.tags`); tiny_vision exports a tuple per tag
TAGS = {
    "before_2026": "added before 2026: the families the default suite runs everywhere (FAMILIES_BEFORE_2026)",
    "router_loss": "a MoE router loss, with which prefix sharing is refused (MOE_FAMILIES)",
    "eager_only": "exact on eager attention only, trained there (EAGER_FAMILIES, apart from VISION_FAMILIES)",
    "minicpm": "MiniCPM-V: a Qwen3.5 language model (MINICPM_FAMILIES)",
    "got_ocr2": "GOT-OCR2's model (GOT_OCR2_FAMILIES)",
}


@dataclass(frozen=True)
class TinyFamily:
    """One tiny vision-language family: its tokens, how its processor and model are built, and what tests select it by.

    Args:
        tokens: the special tokens added to the shipped tokenizer, in this order.
        placeholder: what the chat template writes for an image part; the processor expands it to the image's tokens.
        processor: `(model_type, tokenizer, chat_template, **options)` -> the processor.
        config: `(model_type, processor)` -> the values `AutoConfig.for_model` takes, consistent with the processor.
        named_tokens: the tokenizer's model-specific special tokens (`tokenizer.image_token` ...), which the processor
            reads off it.
        prepare_model: run on the model once built (and seeded): freezes what image pairs never train, draws what
            starts at zero and would cut the gradients behind it.
        attention: the attention it trains on by default (`default_attention`).
        save_original_format: `save_pretrained`'s, for `save_vision_models`.
        after_save: run on a saved model's folder (`save_vision_models`).
        tags: names from `TAGS`.
    """

    tokens: tuple[str, ...]
    placeholder: str
    processor: Callable[..., ProcessorMixin]
    config: Callable[[str, ProcessorMixin], dict]
    named_tokens: Mapping[str, str] = field(default_factory=dict)
    prepare_model: Callable[[PreTrainedModel], None] | None = None
    attention: str = "sdpa"
    save_original_format: bool = True
    after_save: Callable[[Path], None] | None = None
    tags: frozenset[str] = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "tags", frozenset(self.tags))
        if unknown := self.tags - TAGS.keys():
            raise ValueError(f"Unknown tags {sorted(unknown)}; choose from {sorted(TAGS)}.")


# Model shapes: the width of trl_padfree.tiny's decoders, and a vision tower just as small
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
HEAD_DIM = TEXT["hidden_size"] // TEXT["num_attention_heads"]
MROPE_SECTION = [2, 1, 1]  # temporal, height, width: sums to head_dim / 2
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
INIT_STD = 0.02  # the configs' initializer_range
SLIDING_WINDOW = 6  # shorter than every sequence, so a sliding window really cuts

_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize }}:"
    "{%- if message['content'] is string %} {{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '@IMAGE@' }}"
    "{%- elif part['type'] == 'text' %} {{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ eos_token }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}"
)


def chat_template(family: TinyFamily) -> str:
    """`User:<image> text</s>Assistant: text</s>`, with `<image>` the family's placeholder."""
    return _CHAT_TEMPLATE.replace("@IMAGE@", family.placeholder)


def make_tokenizer(family: TinyFamily) -> PreTrainedTokenizerBase:
    """The shipped tokenizer with the family's special tokens added."""
    tokenizer = load_demo_tokenizer()
    tokenizer.add_special_tokens({"extra_special_tokens": list(family.tokens)}, replace_extra_special_tokens=False)
    if family.named_tokens:
        # how a checkpoint's tokenizer config declares the tokens its processor reads by name
        tokenizer._set_model_specific_special_tokens(dict(family.named_tokens))
    return tokenizer


def freeze_post_layernorm(model: PreTrainedModel) -> None:
    """LLaVA's kin take the tower's hidden states, before its post-layernorm: frozen, as it gets no gradient."""
    tower = model.model.vision_tower
    getattr(tower, "vision_model", tower).post_layernorm.requires_grad_(False)
