"""Does an architecture pack exactly? Decided on a tiny float64 twin of the model, not on its weights.

Whether packed sequences stay apart depends on the model's code (how it reads positions, builds masks, mixes tokens)
and on the attention backend, never on the values of its weights. So the check builds a *twin*: the same model class
and attention backend, the same layer pattern (`layer_types`, dense/MoE mix, sliding, chunked and full layers), every
width shrunk, windows and chunks shrunk below the check's sequence lengths, in float64, with zero-initialised tensors
given small random values so that a leak cannot hide behind them. On the twin it compares

    packed:     one forward (and backward) of the row  | s1 | s2 | s3 | s4 | pad |  built as training builds it
    reference:  each sequence alone, `eager` attention, plain `input_ids`, no packing keyword arguments

log-probs and parameter gradients, in training mode (forward and backward, as the policy runs) and in eval mode
(forward, as the reference model runs). The packed side is the training path itself: preference pairs through the
collator (`concatenated_inputs`), `PackedBatch`, its model keyword arguments and the packed forward
(`forward.add_packed_forward`), so a change to any of them is checked here too. Under `kernels.stand_in_kernels` the
packed forward takes its CUDA branches, so the check runs them as well. The verdict is cached per architecture
signature (class, backend, twin config) and kernels in force, so the real model's dtype and ZeRO-3 partitioning do
not matter, and a trainer pays for the check once per process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass

import torch
from transformers import CONFIG_MAPPING, PretrainedConfig, PreTrainedModel

from ..integrations.torch import uncompiled
from ..integrations.transformers import (
    attention_calls_counted,
    set_config_implementations,
    set_language_model_attention,
    without_deepspeed_zero3,
)
from ..integrations.transformers import attn_implementation as running_attention
from ..packing.collator import concatenated_inputs
from ..packing.vision import ImageUnits, pack_vision_batch
from ..refusals import (
    check_attn_implementation,
    check_prefix_sharing_attention,
    refuse_architecture,
)
from .backends import ATTN_IMPLEMENTATION, CHECKED_ON_CPU, FLASH_VARLEN, PACKING_AWARE, checked_backend
from .kernels import branch_key, mixer_kernels, pytorch_fallback_kernels
from .mixers import mixer_calls, mixer_classes, stateful_mixers
from .packed_forward import PackedBatch, add_packed_forward
from .vision import FAMILIES as IMAGE_FAMILIES
from .vision import cross_attention_refusal, image_family, image_token_id
from .vision_twin import remap_special_tokens, twin_geometry, twin_image_inputs

logger = logging.getLogger(__name__)

# The check's pairs, (prompt, chosen, rejected) token counts: sequences of 9, 1, 13 and 5 tokens (chosen, then
# rejected), so one sequence of a single token and others longer than the shrunk windows (3) and chunks (4); the row
# is padded to a multiple of 8, as sequence and context parallelism pad it, so a padding segment ends it
CHECK_PAIRS = ((4, 5, 9), (1, 0, 4))
CHECK_LENGTHS = tuple(pair[0] + pair[side] for side in (1, 2) for pair in CHECK_PAIRS)  # (9, 1, 13, 5)
CHECK_ROW_MULTIPLE = 8
# The prefix-sharing check's pairs
CHECK_SHARED_PAIRS = ((6, 3, 4), (3, 5, 2))
# With images (a vision-language model on image data): (text tokens before the images, images, text tokens after each
# image, chosen tokens, rejected tokens) per pair; a pair of one image and one of two, of different sizes
CHECK_IMAGE_PAIRS = ((2, 1, 2, 3, 5), (1, 2, 1, 1, 4))
CHECK_SHARED_IMAGE_PAIRS = ((3, 1, 2, 2, 4), (2, 2, 2, 3, 1))
CHECK_SPECIAL_TOKENS = 8  # the twin's last token ids, where its special tokens are (vision_twin.remap_special_tokens)
TWIN_SLIDING_WINDOW = 3
TWIN_CHUNK_SIZE = 4
TWIN_VOCAB_SIZE = 64
# Float64 puts rounding far below any leak (float32 noise on a deep twin reached 3e-5); MoE experts then run
# transformers' eager expert loop, the same per-token math as its grouped-GEMM kernels, which take no float64
TWIN_DTYPE = torch.float64

# Largest max-abs difference the check accepts: of log-probs, and of gradients relative to the largest gradient.
# Measured on exact twins: log-probs at most 2e-6 (Gemma 4, whose norms compute in float32; 1e-7 for most), gradients
# at most 3e-5; leaks measured 6e-4 (Falcon-H1's Mamba scan run across the whole row, before mixers.py) to 1.
LOG_PROB_TOLERANCE = 1e-4
GRADIENT_TOLERANCE = 1e-4

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


def _shrink(values: dict) -> dict:
    shrunk = dict(values)
    heads = next((shrunk[name] for name in _HEADS if isinstance(shrunk.get(name), int)), None)
    for name in _HEADS:
        if isinstance(shrunk.get(name), int):
            shrunk[name] = 4
    for name in _KV_HEADS:
        kv_heads = shrunk.get(name)
        if isinstance(kv_heads, int) and heads:
            # Keep the kind of attention: multi-query, grouped-query or multi-head
            shrunk[name] = 1 if kv_heads == 1 else (2 if kv_heads < heads else 4)
    head_dim = shrunk["head_dim"] if isinstance(shrunk.get("head_dim"), int) else None
    for name in _HIDDEN:
        if isinstance(shrunk.get(name), int):
            shrunk[name] = 32 if head_dim is None else 4 * _SHRUNK["head_dim"]
    for name, size in _SHRUNK.items():
        if isinstance(shrunk.get(name), int) and not isinstance(shrunk.get(name), bool):
            shrunk[name] = size
    for name, most in _AT_MOST.items():
        if isinstance(shrunk.get(name), int) and not isinstance(shrunk.get(name), bool):
            shrunk[name] = min(shrunk[name], most)
    for name in shrunk:
        if name.endswith("vocab_size") or name.startswith("vocab_size"):  # vocab_size, vocab_size_per_layer_input...
            if isinstance(shrunk[name], int):
                shrunk[name] = TWIN_VOCAB_SIZE
    if isinstance(shrunk.get("qk_rope_head_dim"), int):
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


def _shrink_override(override: dict, head_dim: int | None) -> dict:
    # Per-layer overrides (Gemma 4's wider full-attention heads): shrunk, keeping their ratio to the base head_dim
    shrunk = _shrink(override)
    if isinstance(override.get("head_dim"), int) and isinstance(head_dim, int) and head_dim > 0:
        shrunk["head_dim"] = max(1, override["head_dim"] // head_dim) * _SHRUNK["head_dim"]
    return shrunk


def _without_derived(values: dict, config_class: type | None) -> dict:
    declared = set()
    if dataclasses.is_dataclass(config_class):
        declared = {field.name for field in dataclasses.fields(config_class)}
    return {name: value for name, value in values.items() if name not in _DERIVED or name in declared}


def twin_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config of the twin: every width shrunk, layer pattern kept, windows and chunks shorter than the check's
    sequences, no dropout. Sub-configs (a multimodal model's text and vision parts) and per-layer overrides are shrunk
    alike."""
    values = config.to_dict()
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:  # a sub-config
            values[key] = _without_derived(_shrink(value), CONFIG_MAPPING.get(value["model_type"]))
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            values[key] = {layer: _shrink_override(v, values.get("head_dim")) for layer, v in value.items()}
    values = _without_derived(_shrink(values), type(config))
    if image_family(config.model_type) is not None:  # small images, image features as wide as the language model
        twin_geometry(config.model_type, values)
        remap_special_tokens(values, TWIN_VOCAB_SIZE)
    values.pop("dtype", None)
    values.pop("_name_or_path", None)
    twin = type(config).from_dict(values)
    set_config_implementations(twin, running_attention(config))
    return twin


def architecture_signature(model_class: type, config: PretrainedConfig, attn_implementation: str) -> str:
    """What the verdict depends on: the class, the attention backend and the twin's config."""
    values = twin_config(config).to_dict()
    for key in ("transformers_version", "architectures", "dtype", "_name_or_path", "_attn_implementation_autoset"):
        values.pop(key, None)
    name = f"{model_class.__module__}.{model_class.__qualname__}"
    return json.dumps([name, attn_implementation, values], sort_keys=True, default=str)


@contextlib.contextmanager
def _one_thread():
    # A twin's matrices are 32 wide: threads only add synchronisation, which on a busy machine costs 10x
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _private_rng(seed: int = 0):
    # The twin's initialisation and random tokens must leave the training run's RNG streams untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# A twin is a few hundred thousand parameters; one far larger means a width field escaped the shrinking
MAX_TWIN_PARAMETERS = 20_000_000


def _check_twin_size(model_class: type, config: PretrainedConfig) -> None:
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(config).parameters())
    if parameters > MAX_TWIN_PARAMETERS:
        raise TwinError(
            f"the twin would have {parameters:,} parameters (at most {MAX_TWIN_PARAMETERS:,}): some width of this "
            "config is not shrunk by trl_padfree.architecture"
        )


def build_twin(model_class: type, config: PretrainedConfig, attn_implementation: str) -> PreTrainedModel:
    """A tiny float64 instance of `model_class` on the CPU, outside any ZeRO-3 context (see module docstring)."""
    try:
        tiny = twin_config(config)
        set_config_implementations(tiny, "eager", experts_implementation="eager")
        # Built whole under ZeRO-3 too: each process checks its own twin, and a composite class would otherwise
        # partition its parts (it builds them with `from_config`), in collectives the other processes never join
        with _private_rng(), without_deepspeed_zero3():
            _check_twin_size(model_class, tiny)
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(TWIN_DTYPE)
            try:
                twin = model_class(tiny)
            finally:
                torch.set_default_dtype(default_dtype)
            twin = twin.to(TWIN_DTYPE).eval()
            for parameter in twin.parameters():
                if not parameter.detach().any():  # a zero tensor hides a leak: a gate at 0 passes nothing on
                    parameter.data.normal_(0.0, TWIN_INITIALIZER_RANGE)
        set_language_model_attention(twin, attn_implementation)
        add_packed_forward(twin)  # as the trainer's models get it, stateful mixers included (mixers.py)
    except Exception as error:  # any failure here is the twin's, reported with what failed
        raise TwinError(f"{type(error).__name__}: {error}") from error
    return twin


@dataclass(frozen=True)
class PackingErrors:
    """Packed vs each sequence alone on the twin: max abs log-prob difference, max abs gradient difference over the
    largest gradient, and how many calls the requested attention function received."""

    log_probs: float
    gradients: float
    attention_calls: int | None  # None: the backend is the model's own eager code, which cannot be counted
    # Stateful mixers (mixers.py) that never received the row's segments: their layers do not pass keywords on
    mixers_without_segments: tuple[str, ...] = ()
    # Stateful mixers that ran the whole row through their kernels (CUDA, or stand-ins), not once per sequence
    whole_row_mixers: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return self.log_probs <= LOG_PROB_TOLERANCE and self.gradients <= GRADIENT_TOLERANCE


def _loss_and_log_probs(logits: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # A fixed random weighting of every log-prob: its gradient reaches every parameter the log-probs depend on
    log_probs = logits.double().log_softmax(-1)
    return (log_probs * weights).sum(), log_probs.detach()


def _gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _relative_gradient_error(packed: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Max abs difference over the largest reference gradient, on the entries finite in both: a deep twin's gradients
    can overflow through a norm of near-zero activations (a Gemma 4 twin's embedding rows did, in both runs and even
    on eager alone), which says nothing about packing. A leak moves the finite entries too, and the log-probs."""
    scale, error = 0.0, 0.0
    for p, r in zip(packed, reference, strict=True):
        finite = p.isfinite() & r.isfinite()
        if finite.any():
            scale = max(scale, float(r[finite].abs().max()))
            error = max(error, float((p[finite] - r[finite]).abs().max()))
    return error / (scale or 1.0)


def _check_row(twin: PreTrainedModel, pairs, prefix_sharing: bool, seed: int) -> tuple[list[dict], PackedBatch]:
    """Random preference pairs of these token counts, packed by the collator as training packs them, and each
    sequence's inputs alone (chosen ones, then rejected ones: the padded view's order)."""
    vocab_size = twin.config.get_text_config().vocab_size
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    with _private_rng(seed):
        examples = [
            {key: torch.randint(vocab_size, (count,)).tolist() for key, count in zip(keys, shape, strict=True)}
            for shape in pairs
        ]
    batch = concatenated_inputs(
        examples,
        pad_to_multiple_of=CHECK_ROW_MULTIPLE,
        prefix_sharing=prefix_sharing,
        prefix_sharing_min_prompt_tokens=2,
    )
    alone = [
        {"input_ids": torch.tensor([example["prompt_ids"] + example[key]])} for key in keys[1:] for example in examples
    ]
    return alone, PackedBatch.from_collated(batch)


def _image_check_row(twin: PreTrainedModel, pairs, prefix_sharing: bool, seed: int) -> tuple[list[dict], PackedBatch]:
    """`_check_row` with images: each pair's prompt holds `images` images between its text tokens, the batch is laid
    out as TRL's vision collator lays it out and packed as training packs it (packing/vision.py), and each sequence
    alone gets its own images."""
    config, family = twin.config, image_family(twin.config.model_type)
    images_per_example = [shape[1] for shape in pairs]
    image_inputs, tokens_per_image = twin_image_inputs(twin, family, images_per_example, seed)
    placeholder = image_token_id(config)
    text_tokens = config.get_text_config().vocab_size - CHECK_SPECIAL_TOKENS  # below the twin's special tokens
    rows, completion_starts, image_index = [[], []], [[], []], 0
    with _private_rng(seed):
        for before, images, after, *completions in pairs:
            prompt = torch.randint(3, text_tokens, (before,)).tolist()
            for count in tokens_per_image[image_index : image_index + images]:
                prompt += [placeholder] * count + torch.randint(3, text_tokens, (after,)).tolist()
            image_index += images
            for side, completion in enumerate(completions):
                rows[side].append(prompt + torch.randint(3, text_tokens, (completion,)).tolist())
                completion_starts[side].append(len(prompt))
    rows, completion_starts = rows[0] + rows[1], completion_starts[0] + completion_starts[1]
    padded = _padded_batch(rows, completion_starts, placeholder, family.token_types) | image_inputs
    batch = pack_vision_batch(
        padded,
        images_per_example * 2,
        placeholder,
        pad_to_multiple_of=CHECK_ROW_MULTIPLE,
        prefix_sharing=prefix_sharing,
        prefix_sharing_min_prompt_tokens=2,
    )
    units = ImageUnits.of(image_inputs, images_per_example * 2, [row.count(placeholder) for row in rows])
    alone = []
    for row, ids in enumerate(rows):
        inputs = {"input_ids": torch.tensor([ids]), **units.of_rows([row])}
        if family.token_types is not None:
            inputs[family.token_types] = (inputs["input_ids"] == placeholder).long()
        alone.append(inputs)
    return alone, PackedBatch.from_collated(batch)


def _padded_batch(rows: list[list[int]], completion_starts: list[int], placeholder: int, token_types: str | None):
    """Rows as TRL's vision collator pads them: flush left, with masks and the per-token image marks."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask, completion_mask = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for row, (ids, start) in enumerate(zip(rows, completion_starts, strict=True)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        completion_mask[row, start : len(ids)] = 1
    padded = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}
    if token_types is not None:
        padded[token_types] = (input_ids == placeholder).long() * attention_mask
    return padded


def _packed_log_probs(twin: PreTrainedModel, packed: PackedBatch) -> torch.Tensor:
    """The packed forward's log-probs of every token of every sequence, in order `(tokens, vocab)`."""
    logits = twin(packed_batch=packed, use_cache=False).logits  # the padded view, (sequences, width, vocab)
    return logits[packed.token_valid].double().log_softmax(-1)


def _alone_log_probs(twin: PreTrainedModel, sequences: list[dict]) -> list[torch.Tensor]:
    return [twin(**inputs, use_cache=False).logits[0].double().log_softmax(-1) for inputs in sequences]


def packing_errors(twin: PreTrainedModel, attn_implementation: str, images: bool = False) -> PackingErrors:
    """Compare the twin's packed forward (training path, `attn_implementation`) with each sequence run alone on eager:
    log-probs and gradients in training mode, log-probs in eval mode; with `images`, on pairs whose prompts hold
    images."""
    if images:
        sequences, packed = _image_check_row(twin, CHECK_IMAGE_PAIRS, prefix_sharing=False, seed=1)
    else:
        sequences, packed = _check_row(twin, CHECK_PAIRS, prefix_sharing=False, seed=1)
    lengths = [inputs["input_ids"].shape[1] for inputs in sequences]
    with _private_rng(1):
        weights = torch.randn(sum(lengths), twin.get_output_embeddings().weight.shape[0], dtype=TWIN_DTYPE)

    twin.train()
    set_language_model_attention(twin, "eager")
    twin.zero_grad(set_to_none=True)
    reference = []
    for log_probs, weight in zip(_alone_log_probs(twin, sequences), weights.split(lengths), strict=True):
        (log_probs * weight).sum().backward()
        reference.append(log_probs.detach())
    reference_log_probs, reference_gradients = torch.cat(reference), _gradients(twin)

    set_language_model_attention(twin, attn_implementation)
    twin.zero_grad(set_to_none=True)
    calls_before = mixer_calls(twin)
    with attention_calls_counted(attn_implementation) as calls:
        packed_log_probs = _packed_log_probs(twin, packed)
    (packed_log_probs * weights).sum().backward()
    packed_gradients = _gradients(twin)
    twin.zero_grad(set_to_none=True)
    calls_after = mixer_calls(twin)
    # Mixers that ran in the packed forward without their segments (a model's audio or vision tower may not run)
    unreached = tuple(
        name
        for name, after in calls_after.items()
        if after.ran > calls_before[name].ran and after.segmented == calls_before[name].segmented
    )
    whole_row = tuple(name for name, after in calls_after.items() if after.whole_row > calls_before[name].whole_row)
    log_prob_error = float((packed_log_probs.detach() - reference_log_probs).abs().max())

    twin.eval()  # the reference model's forward
    with torch.no_grad():
        packed_eval = _packed_log_probs(twin, packed)
        set_language_model_attention(twin, "eager")
        alone_eval = torch.cat(_alone_log_probs(twin, sequences))
        set_language_model_attention(twin, attn_implementation)
    log_prob_error = max(log_prob_error, float((packed_eval - alone_eval).abs().max()))

    return PackingErrors(
        log_probs=log_prob_error,
        gradients=_relative_gradient_error(packed_gradients, reference_gradients),
        attention_calls=None if calls is None else calls.calls,
        mixers_without_segments=unreached,
        whole_row_mixers=whole_row,
    )


def shared_packing_error(twin: PreTrainedModel, attn_implementation: str, images: bool = False) -> float:
    """Max abs log-prob difference between one prefix-sharing forward (training path) of random pairs (with
    `images`, pairs whose prompts hold images) on `attn_implementation` and each sequence alone on eager."""
    if images:
        sequences, packed = _image_check_row(twin, CHECK_SHARED_IMAGE_PAIRS, prefix_sharing=True, seed=2)
    else:
        sequences, packed = _check_row(twin, CHECK_SHARED_PAIRS, prefix_sharing=True, seed=2)
    twin.eval()
    with torch.no_grad():
        set_language_model_attention(twin, attn_implementation)
        shared = _packed_log_probs(twin, packed)
        set_language_model_attention(twin, "eager")
        separate = torch.cat(_alone_log_probs(twin, sequences))
        set_language_model_attention(twin, attn_implementation)
    return float((shared - separate).abs().max())


@dataclass(frozen=True)
class Verdict:
    """Whether an architecture packs exactly on one attention backend, measured on its twin."""

    model_type: str
    model_class: str
    attn_implementation: str
    exact: bool
    reason: str | None  # why not, when not exact (a leak with its size, or what failed)
    errors: PackingErrors | None
    shared_error: float | None  # prefix-sharing forward, when checked
    seconds: float


def _measure(
    model_class: type, config: PretrainedConfig, attn_implementation: str, prefix_sharing: bool, images: bool
) -> Verdict:
    start = time.perf_counter()
    model_type = config.model_type

    def verdict(reason, errors=None, shared_error=None):
        return Verdict(
            model_type,
            model_class.__name__,
            attn_implementation,
            reason is None,
            reason,
            errors,
            shared_error,
            time.perf_counter() - start,
        )

    cross_attention = cross_attention_refusal(config) if images else None
    if cross_attention is not None:
        return verdict(cross_attention)
    if images and image_family(model_type) is None:
        return verdict(
            "trl-padfree does not know how its processor lays out a batch's images, so it cannot check that they "
            "stay with their sequences (the families it knows: " + ", ".join(sorted(IMAGE_FAMILIES)) + ")"
        )
    try:
        twin = build_twin(model_class, config, attn_implementation)
    except TwinError as error:
        return verdict(f"its tiny twin could not be built ({error})")
    try:
        errors = packing_errors(twin, attn_implementation, images=images)
    except Exception as error:  # a backend that cannot run this model is a refusal, with what failed
        return verdict(f"its packed forward failed on a tiny twin ({type(error).__name__}: {error})")
    reason = _packing_refusal(twin, attn_implementation, errors)
    if reason is not None:
        return verdict(reason, errors)
    if not prefix_sharing:
        return verdict(None, errors)
    try:
        shared_error = shared_packing_error(twin, attn_implementation, images=images)
    except Exception as error:
        return verdict(f"its prefix-sharing forward failed on a tiny twin ({type(error).__name__}: {error})", errors)
    if not shared_error <= LOG_PROB_TOLERANCE:
        return verdict(
            f"its prefix-sharing forward differs from each sequence alone by {shared_error:.2g} on a tiny twin "
            "(some layers mix tokens outside the attention)",
            errors,
            shared_error,
        )
    return verdict(None, errors, shared_error)


def _packing_refusal(twin: PreTrainedModel, attn_implementation: str, errors: PackingErrors) -> str | None:
    """Why a twin's packed forward is refused, from what the check measured; None when it is exact."""
    if errors.mixers_without_segments:
        return (
            f"its {', '.join(errors.mixers_without_segments)} layers carry state along the row, and the model does not "
            "hand them the packed row's sequence boundaries (its layers pass no keyword arguments on to them), so "
            "each sequence's state would run into the next"
        )
    # (A model whose mixer layers all take their segments and which packs exactly may have no attention layer at all)
    if errors.attention_calls == 0 and not (mixer_classes(twin) and errors.exact):
        return (
            f"it does not run its attention through `{attn_implementation}` when asked to (it stays on its own "
            "attention code), so the packing keyword arguments are ignored"
        )
    if not errors.exact:
        return (
            f"packed sequences see each other: on a tiny float64 twin the packed log-probs differ from each sequence "
            f"alone by {errors.log_probs:.2g} and the gradients by {errors.gradients:.2g} of their largest "
            f"(tolerance {LOG_PROB_TOLERANCE:g}){_whole_row_kernels(twin, errors.whole_row_mixers)}"
        )
    return None


def _whole_row_kernels(twin: PreTrainedModel, mixer_class_names: tuple[str, ...]) -> str:
    """What a leak's reason adds when stateful mixers ran the whole row through their kernels."""
    if not mixer_class_names:
        return ""
    classes = {type(mixer) for mixer in stateful_mixers(twin) if type(mixer).__name__ in mixer_class_names}
    kernels = {kernel for mixer_class in classes for kernel in mixer_kernels(mixer_class).kernels}
    described = ", ".join(sorted(kernel.described for kernel in kernels if kernel.boundary))
    distributions = ", ".join(sorted({kernel.distribution for kernel in kernels if kernel.boundary}))
    return (
        f"; its {', '.join(mixer_class_names)} layers ran the whole row through {described}, which did not keep the "
        f"sequences apart: uninstall {distributions} (the layers then run once per sequence)"
    )


_VERDICTS: dict[tuple, Verdict] = {}


def check_architecture(
    model_class: type,
    config: PretrainedConfig,
    attn_implementation: str,
    prefix_sharing: bool = False,
    images: bool = False,
) -> Verdict:
    """The verdict for `model_class` built from `config` on `attn_implementation` (with `images`: on image data),
    measured once per process per architecture signature."""
    try:
        signature = architecture_signature(model_class, config, attn_implementation)
        key = (signature, prefix_sharing, images, branch_key())
    except Exception as error:
        return Verdict(
            config.model_type,
            model_class.__name__,
            attn_implementation,
            False,
            f"its tiny twin could not be built ({type(error).__name__}: {error})",
            None,
            None,
            0.0,
        )
    if key not in _VERDICTS:
        # The twin is on the CPU: mixer kernels installed for the GPU would get its tensors (kernels.py)
        with _one_thread(), pytorch_fallback_kernels():
            _VERDICTS[key] = _measure(model_class, config, attn_implementation, prefix_sharing, images)
    return _VERDICTS[key]


# ---- the attention each model packs with ----


def resolve_attn_implementation(requested: str, current: str | None, prefix_sharing: bool = False) -> str:
    """`auto` keeps a flash varlen kernel the model already uses, else picks `padfree_varlen`; `keep` keeps `current`.

    Prefix sharing needs `padfree_varlen`, the one attention that reads the shared layout: `auto` picks it always.
    """
    if requested == "auto":
        return current if current in FLASH_VARLEN and not prefix_sharing else ATTN_IMPLEMENTATION
    resolved = current if requested == "keep" else requested
    if prefix_sharing:
        check_prefix_sharing_attention(resolved)
    return resolved


def architecture_verdict(
    model: torch.nn.Module,
    attn_implementation: str | None = None,
    prefix_sharing: bool = False,
    images: bool = False,
) -> Verdict:
    """Whether `model`'s architecture packs exactly on `attn_implementation` (default: the model's own), with
    `images` on image data, measured on its tiny twin and cached per architecture: the model's weights, dtype and
    partitioning play no part. A model compiled with `torch.compile` is judged on the class under the wrapper."""
    model = uncompiled(model)
    attn_implementation = attn_implementation or running_attention(model)
    backend = checked_backend(attn_implementation)
    return check_architecture(type(model), model.config, backend, prefix_sharing, images)


def choose_packed_attention(
    model: torch.nn.Module, requested: str, prefix_sharing: bool = False, images: bool = False
) -> str:
    """The attention `model` runs packed rows with: `resolve_attn_implementation`, except that `auto` moves on to
    `sdpa`, then `eager`, for an architecture the check finds exact on those but not on `padfree_varlen` (classes
    that keep their own attention code, such as GPT-Neo). The choice is logged; nothing inexact is chosen:
    `check_packable` still decides."""
    resolved = resolve_attn_implementation(requested, running_attention(model), prefix_sharing)
    if requested != "auto" or prefix_sharing or resolved != ATTN_IMPLEMENTATION:
        return resolved
    if architecture_verdict(model, resolved, images=images).exact:
        return resolved
    for backend in CHECKED_ON_CPU[1:]:
        if architecture_verdict(model, backend, images=images).exact:
            logger.info(
                f"packed_attn_implementation='auto': {type(model).__name__} does not pack on `{resolved}` "
                f"({architecture_verdict(model, resolved, images=images).reason}); it packs exactly on `{backend}`, "
                "which it will use."
            )
            return backend
    return resolved


def check_packable(
    model: torch.nn.Module,
    prefix_sharing: bool = False,
    attn_implementation: str | None = None,
    images: bool = False,
) -> None:
    """Refuse a model whose packed forward on `attn_implementation` (default: the model's own), with `images` on
    image data, would differ from its per-sequence forward, as measured on a tiny twin of its architecture, naming the
    backends that would work."""
    attn_implementation = attn_implementation or running_attention(model)
    check_attn_implementation(attn_implementation, PACKING_AWARE)
    verdict = architecture_verdict(model, attn_implementation, prefix_sharing, images)
    if verdict.exact:
        return
    # Refused only because of sharing when the same architecture packs without it
    sharing_alone = prefix_sharing and architecture_verdict(model, attn_implementation, images=images).exact
    working = [
        backend
        for backend in CHECKED_ON_CPU
        if backend != verdict.attn_implementation
        and not (prefix_sharing and backend != ATTN_IMPLEMENTATION)
        and architecture_verdict(model, backend, prefix_sharing, images).exact
    ]
    what = "prefix_sharing" if sharing_alone else "padding_free"
    refuse_architecture(what, verdict.model_class, verdict.model_type, attn_implementation, verdict.reason, working)
