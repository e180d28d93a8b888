"""`trl-padfree models`: which architectures pack, measured, for every decoder-only causal LM of transformers.

`trl-padfree models` checks every model type of `AutoModelForCausalLM` (encoder and encoder-decoder families left
out) on each attention backend, from the type's default config, and prints one row per type: exact, or the reason it
is refused, and how long the check took. `--markdown` prints the table of docs/models-and-backends.md.
`trl-padfree models --check MODEL` reads only the `config.json` of a hub id or local folder and says whether and how
that model will pack: the same check the trainer runs at start-up.

`--vision` checks the image-text-to-text types instead (`AutoModelForImageTextToText`), each on image pairs: a tiny
twin with its vision tower, images laid out as TRL's vision collator lays them out and packed as training packs them.
A type whose images the check cannot give its twin yet is "unchecked", never exact; `--check` on a vision-language
config checks it the same way.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig

from ..integrations.transformers import (
    causal_lm_class_names,
    image_text_to_text_class_names,
    not_decoder_only_types,
)
from ..modeling.backends import CHECKED_ON_CPU as CHECKED_ATTENTION
from ..modeling.packability import Verdict, check_architecture
from ..modeling.vision import cross_attention_refusal, image_family

# A vision-language type whose images the architecture check cannot give its twin yet: not called exact, not refused
# by a measurement either (the trainer refuses it on image data, TRL's padded vision trainer trains it)
UNCHECKED = (
    "unchecked: the check cannot give its twin images yet (no image layout for this family in modeling/vision.py), "
    "so padding_free=True refuses it on image data; TRL's padded trainer (padding_free=False) trains it"
)

# Default configs whose layers are all of one kind, where the released checkpoints mix state-space or convolution layers
# with attention: the table checks a pattern like the checkpoints' (a real checkpoint's own config is what the trainer
# and `--check` check)
CHECKPOINT_LIKE_LAYERS = {
    "lfm2": dict(num_hidden_layers=6, layer_types=["conv", "conv", "full_attention"] * 2),
    "lfm2_moe": dict(num_hidden_layers=6, num_dense_layers=2, layer_types=["conv", "conv", "full_attention"] * 2),
    "bamba": dict(num_hidden_layers=6, attn_layer_indices=[2, 5]),
    "granitemoehybrid": dict(num_hidden_layers=6, layer_types=["linear_attention"] * 5 + ["full_attention"]),
}


@functools.cache
def decoder_model_types() -> list[str]:
    """Every model type `AutoModelForCausalLM` knows, less encoder and encoder-decoder families."""
    return sorted(
        model_type
        for model_type in set(causal_lm_class_names()) - not_decoder_only_types()
        if not _is_encoder_decoder(model_type)
    )


def _is_encoder_decoder(model_type: str) -> bool:
    try:
        return bool(AutoConfig.for_model(model_type).is_encoder_decoder)
    except Exception:  # a default config that cannot be built still gets its row, with the reason
        return False


def model_class_for(config: PretrainedConfig) -> tuple[type, PretrainedConfig]:
    """The class `AutoModelForCausalLM` builds for `config`, and the config that class takes (a multimodal config's
    causal LM may take only its text config)."""
    name = causal_lm_class_names().get(config.model_type)
    if name is None:
        raise ValueError(
            f"Model type {config.model_type!r} is not a causal LM of transformers {transformers.__version__} "
            "(models with custom code: load the model and call `trl_padfree.modeling.packability.architecture_verdict(model)`)."
        )
    model_class = getattr(transformers, name)
    config_class = getattr(model_class, "config_class", None)
    if config_class is not None and not isinstance(config, config_class):
        text_config = config.get_text_config()
        if isinstance(text_config, config_class):
            return model_class, text_config
    return model_class, config


@dataclass(frozen=True)
class CoverageRow:
    model_type: str
    model_class: str
    verdicts: dict[str, Verdict]  # by attention backend

    @property
    def seconds(self) -> float:
        return sum(verdict.seconds for verdict in self.verdicts.values())


def _refused_row(model_type: str, model_class: str, reason: str, backends) -> CoverageRow:
    verdicts = {
        backend: Verdict(model_type, model_class, backend, False, reason, None, None, 0.0) for backend in backends
    }
    return CoverageRow(model_type, model_class, verdicts)


def check_model_type(model_type: str, backends=CHECKED_ATTENTION) -> CoverageRow:
    """Verdicts for `model_type`'s default config on each backend (`CHECKPOINT_LIKE_LAYERS` for a few hybrids)."""
    try:
        config = AutoConfig.for_model(model_type, **CHECKPOINT_LIKE_LAYERS.get(model_type, {}))
        model_class, config = model_class_for(config)
    except Exception as error:
        reason = f"its default config cannot be built ({type(error).__name__}: {' '.join(str(error).split())})"
        return _refused_row(model_type, "?", reason, backends)
    try:
        with torch.device("meta"):  # no memory: only whether the class accepts its own default config
            model_class(config)
    except Exception as error:
        reason = (
            f"its default config does not build a model ({type(error).__name__}: {' '.join(str(error).split())}); "
            "check a real checkpoint's config with --check"
        )
        return _refused_row(model_type, model_class.__name__, reason, backends)
    verdicts = {backend: check_architecture(model_class, config, backend) for backend in backends}
    return CoverageRow(model_type, model_class.__name__, verdicts)


@functools.cache
def vision_language_types() -> list[str]:
    """Every model type `AutoModelForImageTextToText` knows (the classes TRL's vision-language DPO trains)."""
    return sorted(image_text_to_text_class_names())


def check_vision_model_type(model_type: str, backends=CHECKED_ATTENTION) -> CoverageRow:
    """Verdicts for an image-text-to-text type's default config on each backend, measured on image pairs; `UNCHECKED`
    where the check cannot give the twin images."""
    name = image_text_to_text_class_names()[model_type]
    model_class = getattr(transformers, name, None)
    if model_class is None:
        return _refused_row(
            model_type, name, f"transformers {transformers.__version__} does not export {name}", backends
        )
    try:
        config = AutoConfig.for_model(model_type)
    except Exception as error:
        reason = f"its default config cannot be built ({type(error).__name__}: {' '.join(str(error).split())})"
        return _refused_row(model_type, name, reason, backends)
    if getattr(config, "is_encoder_decoder", False):
        reason = "an encoder-decoder: the packed row is a decoder's sequences; train it padded (padding_free=False)"
        return _refused_row(model_type, name, reason, backends)
    if image_family(model_type) is None and cross_attention_refusal(config) is None:
        return _refused_row(model_type, name, UNCHECKED, backends)
    verdicts = {backend: check_architecture(model_class, config, backend, images=True) for backend in backends}
    return CoverageRow(model_type, name, verdicts)


def _cell(verdict: Verdict) -> str:
    if verdict.exact:
        return "exact"
    if verdict.reason == UNCHECKED:
        return "unchecked"
    if verdict.errors is not None and verdict.reason.startswith("packed sequences see each other"):
        return f"leaks {verdict.errors.log_probs:.1g}"
    return "refused"


def summary_counts(rows: list[CoverageRow], backend: str) -> dict[str, int]:
    """How many model types are exact, leak, or are refused for another reason on `backend`."""
    counts: dict[str, int] = {}
    for row in rows:
        cell = _cell(row.verdicts[backend]).split()[0]
        counts[cell] = counts.get(cell, 0) + 1
    return counts


def markdown_table(rows: list[CoverageRow], backends=CHECKED_ATTENTION) -> str:
    header = ["Model type", "Class", *backends, "Check (s)", "Why not (first refused backend)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(row.verdicts[backend]) for backend in backends]
        refused = next((row.verdicts[b] for b in backends if not row.verdicts[b].exact), None)
        why = "" if refused is None else " ".join(refused.reason.split()).replace("|", "\\|")[:160]
        lines.append(
            f"| `{row.model_type}` | {row.model_class} | " + " | ".join(cells) + f" | {row.seconds:.1f} | {why} |"
        )
    return "\n".join(lines)


def describe(verdicts: dict[str, Verdict]) -> str:
    """Plain-language answer for one model: which backends pack it, and why the others do not."""
    lines = []
    for backend, verdict in verdicts.items():
        status = "packs exactly" if verdict.exact else f"refused: {verdict.reason}"
        lines.append(f"  {backend:16s} {status} ({verdict.seconds:.1f} s)")
    return "\n".join(lines)


def check_pretrained(name_or_path: str, backends=CHECKED_ATTENTION, trust_remote_code: bool = False) -> str:
    """`--check MODEL`: read only the config of a hub id or local folder and say how the model will pack (a
    vision-language model's on image pairs, as TRL's vision trainer loads it)."""
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    vision_class = image_text_to_text_class_names().get(config.model_type)
    if vision_class is not None and hasattr(transformers, vision_class):
        model_class = getattr(transformers, vision_class)
        if image_family(config.model_type) is None and cross_attention_refusal(config) is None:
            verdicts = {backend: Verdict(config.model_type, vision_class, backend, False, UNCHECKED, None, None, 0.0)
                        for backend in backends}  # fmt: skip
        else:
            verdicts = {backend: check_architecture(model_class, config, backend, images=True) for backend in backends}
    else:
        model_class, config = model_class_for(config)
        verdicts = {backend: check_architecture(model_class, config, backend) for backend in backends}
    exact = [backend for backend, verdict in verdicts.items() if verdict.exact]
    if "padfree_varlen" in exact:
        advice = "padding_free=True trains it with the default packed_attn_implementation='auto'."
    elif exact:
        advice = f"padding_free=True trains it with packed_attn_implementation={exact[0]!r}."
    else:
        advice = "padding_free=True refuses it; train it with padding_free=False."
    title = f"{name_or_path}: {model_class.__name__} (model type {config.model_type!r})"
    return f"{title}\n{describe(verdicts)}\n{advice}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", metavar="MODEL", help="hub id or local folder: check only this model's config")
    parser.add_argument("--types", nargs="+", metavar="TYPE", help="check only these model types")
    parser.add_argument(
        "--vision", action="store_true", help="the image-text-to-text types, checked on image pairs, instead"
    )
    parser.add_argument("--backends", nargs="+", default=list(CHECKED_ATTENTION), choices=CHECKED_ATTENTION)
    parser.add_argument("--markdown", action="store_true", help="print the markdown table of the docs")
    parser.add_argument("--trust-remote-code", action="store_true", help="with --check: allow custom config code")
    parser.set_defaults(run=run)


def run(options: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()  # default configs of many types warn about their own token ids
    if options.check:
        print(check_pretrained(options.check, tuple(options.backends), options.trust_remote_code))
        return 0
    known = vision_language_types() if options.vision else decoder_model_types()
    check_type = check_vision_model_type if options.vision else check_model_type
    types = options.types or known
    unknown = sorted(set(types) - set(known))
    if unknown:
        kind = "image-text-to-text" if options.vision else "decoder-only causal LM"
        raise ValueError(f"Not {kind} types of this transformers: {unknown}.")
    start = time.perf_counter()
    rows = []
    for index, model_type in enumerate(types, 1):
        row = check_type(model_type, tuple(options.backends))
        rows.append(row)
        if not options.markdown:
            cells = "  ".join(f"{backend}={_cell(row.verdicts[backend])}" for backend in options.backends)
            print(f"[{index}/{len(types)}] {model_type:26s} {cells}  ({row.seconds:.1f} s)", flush=True)
        else:
            print(f"[{index}/{len(types)}] {model_type}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    if options.markdown:
        print(markdown_table(rows, tuple(options.backends)))
    print(
        f"\n{len(rows)} model types, transformers {transformers.__version__}, {elapsed:.0f} s in all. "
        + "; ".join(f"{backend}: {summary_counts(rows, backend)}" for backend in options.backends)
    )
    return 0
