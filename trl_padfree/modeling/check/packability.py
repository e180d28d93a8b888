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
(`forward.add_packed_forward`), so a change to any of them is checked here too. The twin runs on the CPU, on
transformers' PyTorch fallbacks, on a GPU machine and under the tests' stand-in kernels alike (`kernels.cpu_twin_kernels`):
the kernels' own limits are planned from the real model's shapes (attention/plan.py). The verdict is cached per
architecture signature (class, backend, twin config), so the real model's dtype and ZeRO-3 partitioning do not matter,
and a trainer pays for the check once per process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

from ...integrations.torch import uncompiled
from ...integrations.transformers import (
    attention_calls_counted,
    set_language_model_attention,
)
from ...integrations.transformers import attn_implementation as running_attention
from ...packing.collator import concatenated_inputs
from ...packing.vision import ImageUnits, pack_vision_batch
from ...refusals.models import check_attn_implementation, check_prefix_sharing_attention, refuse_architecture
from ..backends import ATTN_IMPLEMENTATION, CHECKED_ON_CPU, FLASH_VARLEN, PACKING_AWARE, checked_backend
from ..families import image_family, image_refusal, unchecked_verdict
from ..mixers import mixer_calls, mixer_classes
from ..packed_forward import PackedBatch
from ..vision import cross_attention_refusal, image_token_id, vision_tower_left_out
from .family_twins import twin_image_inputs
from .stand_ins import cpu_twin_kernels
from .twin import TWIN_DTYPE, TwinError, architecture_signature, build_twin, one_thread, private_rng

logger = logging.getLogger(__name__)

# The check's pairs, (prompt, chosen, rejected) token counts: sequences of 9, 1, 13 and 5 tokens (chosen, then
# rejected), so one sequence of a single token and others longer than the shrunk windows (3) and chunks (4); the row
# is padded to a multiple of 8, as sequence and context parallelism pad it, so a padding segment ends it
CHECK_PAIRS = ((4, 5, 9), (1, 0, 4))
CHECK_ROW_MULTIPLE = 8
# The prefix-sharing check's pairs
CHECK_SHARED_PAIRS = ((6, 3, 4), (3, 5, 2))
# With images (a vision-language model on image data): (text tokens before the images, images, text tokens after each
# image, chosen tokens, rejected tokens) per pair; a pair of one image and one of two, of different sizes
CHECK_IMAGE_PAIRS = ((2, 1, 2, 3, 5), (1, 2, 1, 1, 4))
CHECK_SHARED_IMAGE_PAIRS = ((3, 1, 2, 2, 4), (2, 2, 2, 3, 1))
CHECK_SPECIAL_TOKENS = (
    8  # the twin's last token ids, where its special tokens are (check/family_twins.py's remap_special_tokens)
)
# Largest max-abs difference the check accepts: of log-probs, and of gradients relative to the largest gradient.
# Measured on exact twins: log-probs at most 2e-6 (Gemma 4, whose norms compute in float32; 1e-7 for most), gradients
# at most 3e-5; leaks measured 6e-4 (Falcon-H1's Mamba scan run across the whole row, before mixers.py) to 1.
LOG_PROB_TOLERANCE = 1e-4
GRADIENT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class PackingErrors:
    """Packed vs each sequence alone on the twin: max abs log-prob difference, max abs gradient difference over the
    largest gradient, and how many calls the requested attention function received."""

    log_probs: float
    gradients: float
    attention_calls: int | None  # None: the backend is the model's own eager code, which cannot be counted
    # Stateful mixers (mixers.py) that never received the row's segments: their layers do not pass keywords on
    mixers_without_segments: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return self.log_probs <= LOG_PROB_TOLERANCE and self.gradients <= GRADIENT_TOLERANCE


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


def check_row(twin: PreTrainedModel, pairs, prefix_sharing: bool, seed: int) -> tuple[list[dict], PackedBatch]:
    """Random preference pairs of these token counts, packed by the collator as training packs them, and each
    sequence's inputs alone (chosen ones, then rejected ones: the padded view's order)."""
    vocab_size = twin.config.get_text_config().vocab_size
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    with private_rng(seed):
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
    """`check_row` with images: each pair's prompt holds `images` images between its text tokens, the batch is laid
    out as TRL's vision collator lays it out and packed as training packs it (packing/vision.py), and each sequence
    alone gets its own images."""
    config, family = twin.config, image_family(twin.config.model_type)
    images_per_example = [shape[1] for shape in pairs]
    image_inputs, tokens_per_image = twin_image_inputs(twin, family, images_per_example, seed)
    placeholder = image_token_id(config)
    # the tokens its processor writes around each image, where its position function finds images by them
    opening, closing = [[getattr(config, name)] for name in family.image_bounds] if family.image_bounds else ([], [])
    text_tokens = config.get_text_config().vocab_size - CHECK_SPECIAL_TOKENS  # below the twin's special tokens
    rows, completion_starts, image_index = [[], []], [[], []], 0
    with private_rng(seed):
        for before, images, after, *completions in pairs:
            prompt = torch.randint(3, text_tokens, (before,)).tolist()
            for count in tokens_per_image[image_index : image_index + images]:
                prompt += opening + [placeholder] * count + closing + torch.randint(3, text_tokens, (after,)).tolist()
            image_index += images
            for side, completion in enumerate(completions):
                rows[side].append(prompt + torch.randint(3, text_tokens, (completion,)).tolist())
                completion_starts[side].append(len(prompt))
    rows, completion_starts = rows[0] + rows[1], completion_starts[0] + completion_starts[1]
    padded = _padded_batch(rows, completion_starts, placeholder, family.token_types) | image_inputs
    if family.expert_token_types is not None:  # the twin's images have no begin and end tokens to mark
        padded[family.expert_token_types] = padded[family.token_types]
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
        if family.expert_token_types is not None:
            inputs[family.expert_token_types] = inputs[family.token_types]
        if family.image_bounds is not None:  # its forward places images only given a mask
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
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


class UnpackedForwardError(RuntimeError):
    """The twin's forward failed on each sequence alone, unpacked: the model does not run on this transformers."""


def packing_errors(twin: PreTrainedModel, attn_implementation: str, images: bool = False) -> PackingErrors:
    """Compare the twin's packed forward (training path, `attn_implementation`) with each sequence run alone on eager:
    log-probs and gradients in training mode, log-probs in eval mode; with `images`, on pairs whose prompts hold
    images."""
    if images:
        sequences, packed = _image_check_row(twin, CHECK_IMAGE_PAIRS, prefix_sharing=False, seed=1)
    else:
        sequences, packed = check_row(twin, CHECK_PAIRS, prefix_sharing=False, seed=1)
    lengths = [inputs["input_ids"].shape[1] for inputs in sequences]
    with private_rng(1):
        weights = torch.randn(sum(lengths), twin.get_output_embeddings().weight.shape[0], dtype=TWIN_DTYPE)

    twin.train()
    set_language_model_attention(twin, "eager")
    twin.zero_grad(set_to_none=True)
    try:
        alone = _alone_log_probs(twin, sequences)
    except Exception as error:
        raise UnpackedForwardError(f"{type(error).__name__}: {error}") from error
    reference = []
    for log_probs, weight in zip(alone, weights.split(lengths), strict=True):
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
    )


def shared_packing_error(twin: PreTrainedModel, attn_implementation: str, images: bool = False) -> float:
    """Max abs log-prob difference between one prefix-sharing forward (training path) of random pairs (with
    `images`, pairs whose prompts hold images) on `attn_implementation` and each sequence alone on eager."""
    if images:
        sequences, packed = _image_check_row(twin, CHECK_SHARED_IMAGE_PAIRS, prefix_sharing=True, seed=2)
    else:
        sequences, packed = check_row(twin, CHECK_SHARED_PAIRS, prefix_sharing=True, seed=2)
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

    refused_on_images = _refused_on_images(config) if images else None
    if refused_on_images is not None:
        return verdict(refused_on_images)
    try:
        twin = build_twin(model_class, config, attn_implementation)
    except TwinError as error:
        return verdict(f"its tiny twin could not be built ({error})")
    try:
        errors = packing_errors(twin, attn_implementation, images=images)
    except UnpackedForwardError as error:
        return verdict(
            f"its forward fails on a tiny twin without packing too ({error}), so there is no padded result to pack "
            f"equal to; where TRL's padded trainer (padding_free=False) fails the same way, transformers "
            f"{transformers.__version__} cannot train it: try another transformers release"
        )
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


def _refused_on_images(config: PretrainedConfig) -> str | None:
    """Why image data is refused whatever a twin would measure (looked at, or not checked yet), or None."""
    if vision_tower_left_out(config):  # nothing to encode images with: it trains on text, as padded TRL trains it
        return (
            "its config has no vision tower (vision_config=None), so it takes no images: the model is its language "
            "model alone, checked on text pairs (`trl-padfree models --check` on this config says how it packs)"
        )
    known_refusal = cross_attention_refusal(config) or image_refusal(config.model_type)
    if known_refusal is not None:
        return known_refusal
    return unchecked_verdict(config.model_type) if image_family(config.model_type) is None else None


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
            f"(tolerance {LOG_PROB_TOLERANCE:g})"
        )
    return None


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
        key = (signature, prefix_sharing, images)
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
        # The twin is on the CPU, as on a GPU machine: PyTorch fallbacks, no CUDA branch (stand_ins.py)
        with one_thread(), cpu_twin_kernels():
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


@dataclass(frozen=True)
class CheckedModel:
    """What the check reads of a model, once, at its entry points: its class (under `torch.compile`'s wrapper), its
    config, the attention it runs now, and whether it trains on images."""

    model_class: type
    config: PretrainedConfig
    attention: str | None
    images: bool = False

    def verdict(self, attn_implementation: str, prefix_sharing: bool = False) -> Verdict:
        backend = checked_backend(attn_implementation)
        return check_architecture(self.model_class, self.config, backend, prefix_sharing, self.images)


def _read_model(model: torch.nn.Module, images: bool) -> CheckedModel:
    model = uncompiled(model)
    return CheckedModel(type(model), model.config, running_attention(model), images)


def architecture_verdict(
    model: torch.nn.Module,
    attn_implementation: str | None = None,
    prefix_sharing: bool = False,
    images: bool = False,
) -> Verdict:
    """Whether `model`'s architecture packs exactly on `attn_implementation` (default: the model's own), with
    `images` on image data, measured on its tiny twin and cached per architecture: the model's weights, dtype and
    partitioning play no part. A model compiled with `torch.compile` is judged on the class under the wrapper."""
    checked = _read_model(model, images)
    return checked.verdict(attn_implementation or checked.attention, prefix_sharing)


def verify_packable(
    model: torch.nn.Module,
    requested: str,
    prefix_sharing: bool = False,
    needs_padfree_varlen: bool = False,
    images: bool = False,
) -> str:
    """The attention backend `model` packs its rows with, decided before training: `requested` resolved
    (`choose_packed_attention`), then the architecture checked on it, with `prefix_sharing` and with `images` on image
    data (`check_packable`: an architecture that does not pack exactly is refused). `needs_padfree_varlen`: the
    training reads the row in `padfree_varlen` (prefix sharing, context parallelism), which `auto` picks for it. The
    model is read once, here (`CheckedModel`)."""
    checked = _read_model(model, images)
    backend = _choose(checked, requested, needs_padfree_varlen)
    _refuse_unless_packable(checked, backend, prefix_sharing)
    return backend


def choose_packed_attention(
    model: torch.nn.Module, requested: str, prefix_sharing: bool = False, images: bool = False
) -> str:
    """The attention `model` runs packed rows with: `resolve_attn_implementation`, except that `auto` moves on to
    `sdpa`, then `eager`, for an architecture the check finds exact on those but not on `padfree_varlen` (classes
    that keep their own attention code, such as GPT-Neo). The choice is logged; nothing inexact is chosen:
    `check_packable` still decides."""
    return _choose(_read_model(model, images), requested, prefix_sharing)


def check_packable(
    model: torch.nn.Module,
    prefix_sharing: bool = False,
    attn_implementation: str | None = None,
    images: bool = False,
) -> None:
    """Refuse a model whose packed forward on `attn_implementation` (default: the model's own), with `images` on
    image data, would differ from its per-sequence forward, as measured on a tiny twin of its architecture, naming the
    backends that would work."""
    checked = _read_model(model, images)
    _refuse_unless_packable(checked, attn_implementation or checked.attention, prefix_sharing)


def _choose(checked: CheckedModel, requested: str, prefix_sharing: bool) -> str:
    resolved = resolve_attn_implementation(requested, checked.attention, prefix_sharing)
    if requested != "auto" or prefix_sharing or resolved != ATTN_IMPLEMENTATION:
        return resolved
    if checked.verdict(resolved).exact:
        return resolved
    for backend in CHECKED_ON_CPU[1:]:
        if checked.verdict(backend).exact:
            logger.info(
                f"packed_attn_implementation='auto': {checked.model_class.__name__} does not pack on `{resolved}` "
                f"({checked.verdict(resolved).reason}); it packs exactly on `{backend}`, which it will use."
            )
            return backend
    return resolved


def _refuse_unless_packable(checked: CheckedModel, attn_implementation: str, prefix_sharing: bool) -> None:
    check_attn_implementation(attn_implementation, PACKING_AWARE)
    verdict = checked.verdict(attn_implementation, prefix_sharing)
    if verdict.exact:
        return
    # Refused only because of sharing when the same architecture packs without it
    sharing_alone = prefix_sharing and checked.verdict(attn_implementation).exact
    working = [
        backend
        for backend in CHECKED_ON_CPU
        if backend != verdict.attn_implementation
        and not (prefix_sharing and backend != ATTN_IMPLEMENTATION)
        and checked.verdict(backend, prefix_sharing).exact
    ]
    what = "prefix_sharing" if sharing_alone else "padding_free"
    refuse_architecture(what, verdict.model_class, verdict.model_type, attn_implementation, verdict.reason, working)
