"""`trl-padfree models`: which architectures pack, measured, for every decoder-only causal LM of transformers.

`trl-padfree models` checks every model type of `AutoModelForCausalLM` (encoder and encoder-decoder families left
out) on each attention backend, from the type's default config, and prints one row per type: exact, or the reason it
is refused, and how long the check took. `--markdown` prints the table of docs/reference/models-table.md.
`trl-padfree models --check MODEL` reads only the `config.json` of a hub id or local folder and says whether and how
that model will pack: the same check the trainer runs at start-up.

For `padfree_varlen`, each exact type also gets its kernel coverage (modeling/check/kernel_coverage.py): how many of its
attention layers run one fused kernel call on a GPU in TRL's default precision, planned at the default config's real
head dims, which kernel beyond torch's varlen kernel (the sink correction, flash-attn or FlexAttention for softcapping,
the memory-efficient kernel for head dims above 256), and why any other runs per segment.

`--vision` checks the image-text-to-text types instead (`AutoModelForImageTextToText`), each on image pairs: a tiny
twin with its vision tower, images laid out as TRL's vision collator lays them out and packed as training packs them.
A type whose images the check cannot give its twin yet is "unchecked", never exact; `--check` on a vision-language
config checks it the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from ..modeling.attention.plan import VARLEN
from ..modeling.backends import ATTN_IMPLEMENTATION
from ..modeling.backends import CHECKED_ON_CPU as CHECKED_ATTENTION
from ..modeling.check.kernel_coverage import KernelCoverage, kernel_coverage
from ..modeling.check.packability import Verdict, check_architecture
from ..modeling.families import UNCHECKED, image_family, image_refusal, unchecked_verdict
from ..modeling.vision import cross_attention_refusal, vision_tower_left_out
from ..sources import load_model_config

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
            "(models with custom code: load the model and call `trl_padfree.modeling.check.packability.architecture_verdict(model)`)."
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
    kernel: KernelCoverage | None = None  # where it packs exactly on padfree_varlen: its layers on the GPU kernel

    @property
    def seconds(self) -> float:
        return sum(verdict.seconds for verdict in self.verdicts.values())


def _with_kernel_coverage(row: CoverageRow, model_class: type, config: PretrainedConfig) -> CoverageRow:
    verdict = row.verdicts.get(ATTN_IMPLEMENTATION)
    if verdict is None or not verdict.exact:
        return row
    return dataclasses.replace(row, kernel=kernel_coverage(model_class, config))


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
    return _with_kernel_coverage(CoverageRow(model_type, model_class.__name__, verdicts), model_class, config)


@functools.cache
def vision_language_types() -> list[str]:
    """Every model type `AutoModelForImageTextToText` knows (the classes TRL's vision-language DPO trains)."""
    return sorted(image_text_to_text_class_names())


def check_vision_model_type(model_type: str, backends=CHECKED_ATTENTION) -> CoverageRow:
    """Verdicts for an image-text-to-text type's default config on each backend, measured on image pairs; "unchecked"
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
    if hasattr(config, "vision_config") and config.vision_config is None:
        # A default that leaves its vision tower out (Gemma 4): checked with the default tower, as checkpoints have one
        config = AutoConfig.for_model(model_type, vision_config={})
    known_refusal = image_refusal(model_type)
    if known_refusal is not None:
        return _refused_row(model_type, name, known_refusal, backends)
    if image_family(model_type) is None and cross_attention_refusal(config) is None:
        return _refused_row(model_type, name, unchecked_verdict(model_type), backends)
    verdicts = {backend: check_architecture(model_class, config, backend, images=True) for backend in backends}
    return _with_kernel_coverage(CoverageRow(model_type, name, verdicts), model_class, config)


def _cell(verdict: Verdict) -> str:
    if verdict.exact:
        return "exact"
    if verdict.reason.startswith(UNCHECKED):
        return UNCHECKED
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


def _kernel_cells(coverage: KernelCoverage | None) -> list[str]:
    if coverage is None:
        return ["", ""]
    others = [f"{count} {kernel}" for kernel, count in coverage.kernels if kernel != VARLEN]
    per_segment = [f"{count} per segment: {why}" for why, count in coverage.per_segment]
    return [coverage.cell, (coverage.error or "; ".join(others + per_segment)).replace("|", "\\|")[:120]]


def kernel_summary(coverages: list[KernelCoverage]) -> str:
    """One line over the exact types' kernel coverage: types wholly on fused kernels, layers on each, and why not."""
    planned = [coverage for coverage in coverages if coverage.error is None]
    whole = sum(coverage.on_kernel == coverage.layers for coverage in planned)
    layers = sum(coverage.layers for coverage in planned)
    on_kernel = sum(coverage.on_kernel for coverage in planned)
    kernels: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for coverage in planned:
        for kernel, count in coverage.kernels:
            kernels[kernel] = kernels.get(kernel, 0) + count
        for why, count in coverage.per_segment:
            reason = why.split(" (")[0] if why.startswith("head dim") else why
            reasons[reason] = reasons.get(reason, 0) + count

    def most_first(counts: dict[str, int]) -> str:
        return "; ".join(f"{count} {name}" for name, count in sorted(counts.items(), key=lambda item: -item[1]))

    return (
        f"{ATTN_IMPLEMENTATION} on a GPU (bf16): {whole} of {len(planned)} exact types with every attention layer on "
        f"a fused kernel; {on_kernel} of {layers} layers on one ({most_first(kernels) or 'none'}); per segment: "
        f"{most_first(reasons) or 'none'}"
        + (f"; {len(coverages) - len(planned)} not planned" if len(planned) < len(coverages) else "")
    )


def markdown_table(rows: list[CoverageRow], backends=CHECKED_ATTENTION) -> str:
    header = ["Model type", "Class", *backends, "Check (s)", "Why not (first refused backend)"]
    kernel = any(row.kernel is not None for row in rows)
    if kernel:  # after the verdicts: layers on a fused kernel on a GPU (bf16), which kernels, and why not
        header[2 + len(backends) : 2 + len(backends)] = ["Fused-kernel layers (bf16)", "Other kernels; per segment"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(row.verdicts[backend]) for backend in backends]
        if kernel:
            cells += _kernel_cells(row.kernel)
        refused = next((row.verdicts[b] for b in backends if not row.verdicts[b].exact), None)
        why = "" if refused is None else " ".join(refused.reason.split()).replace("|", "\\|")[:160]
        lines.append(
            f"| `{row.model_type}` | {row.model_class} | " + " | ".join(cells) + f" | {row.seconds:.1f} | {why} |"
        )
    return "\n".join(lines)


def describe(verdicts: dict[str, Verdict], coverage: KernelCoverage | None = None) -> str:
    """Plain-language answer for one model: which backends pack it, and why the others do not (a reason shared by
    every backend said once); on `padfree_varlen`, what runs on the GPU kernel."""
    reasons = {verdict.reason for verdict in verdicts.values()}
    if len(verdicts) > 1 and len(reasons) == 1:  # one verdict, shared by every backend: said once
        seconds = sum(verdict.seconds for verdict in verdicts.values())
        reason = reasons.pop()
        status = (
            "packs exactly" if reason is None else reason if reason.startswith(UNCHECKED) else f"refused: {reason}"
        )
        lines = [f"  {', '.join(verdicts)}: {status} ({seconds:.1f} s)"]
    else:
        lines = []
        for backend, verdict in verdicts.items():
            status = "packs exactly" if verdict.exact else f"refused: {verdict.reason}"
            lines.append(f"  {backend:16s} {status} ({verdict.seconds:.1f} s)")
    if coverage is not None:
        lines.append(f"  on a GPU (TRL's default precision, its real head dims): {coverage.describe()}")
    return "\n".join(lines)


def check_pretrained(name_or_path: str, backends=CHECKED_ATTENTION, trust_remote_code: bool = False) -> str:
    """`--check MODEL`: read only the config of a hub id or local folder and say how the model will pack (a
    vision-language model's on image pairs, as TRL's vision trainer loads it)."""
    config = load_model_config(name_or_path, trust_remote_code)
    vision_class = image_text_to_text_class_names().get(config.model_type)
    # A vision-language config without its vision tower (Gemma 4's default) builds its language model alone: checked
    # on text pairs, as padded TRL trains it
    takes_images = not vision_tower_left_out(config)
    if vision_class is not None and hasattr(transformers, vision_class) and takes_images:
        model_class = getattr(transformers, vision_class)
        reason = image_refusal(config.model_type)
        if reason is None and image_family(config.model_type) is None and cross_attention_refusal(config) is None:
            reason = unchecked_verdict(config.model_type)
        if reason is not None:
            verdicts = {backend: Verdict(config.model_type, vision_class, backend, False, reason, None, None, 0.0)
                        for backend in backends}  # fmt: skip
        else:
            verdicts = {backend: check_architecture(model_class, config, backend, images=True) for backend in backends}
    else:
        model_class, config = model_class_for(config)
        verdicts = {backend: check_architecture(model_class, config, backend) for backend in backends}
    coverage = None
    if verdicts.get(ATTN_IMPLEMENTATION) is not None and verdicts[ATTN_IMPLEMENTATION].exact:
        coverage = kernel_coverage(model_class, config)
    exact = [backend for backend, verdict in verdicts.items() if verdict.exact]
    if "padfree_varlen" in exact:
        advice = "padding_free=True trains it with the default packed_attn_implementation='auto'."
    elif exact:
        advice = f"padding_free=True trains it with packed_attn_implementation={exact[0]!r}."
    else:
        advice = "padding_free=True refuses it; train it with padding_free=False."
    title = f"{name_or_path}: {model_class.__name__} (model type {config.model_type!r})"
    if not takes_images:
        title += ", no vision tower in its config: a text model, checked on text pairs"
    return f"{title}\n{describe(verdicts, coverage)}\n{advice}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", metavar="MODEL", help="hub id or local folder: check only this model's config")
    parser.add_argument("--types", nargs="+", metavar="TYPE", help="check only these model types")
    parser.add_argument(
        "--vision", action="store_true", help="the image-text-to-text types, checked on image pairs, instead"
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=list(CHECKED_ATTENTION),
        choices=CHECKED_ATTENTION,
        help="the attention backends to check each type on (default: all three)",
    )
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
            if row.kernel is not None:
                cells += f"  varlen-kernel-layers={row.kernel.cell}"
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
    planned = [row.kernel for row in rows if row.kernel is not None]
    if planned:
        print(kernel_summary(planned))
    return 0
