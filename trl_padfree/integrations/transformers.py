"""transformers' private names trl-padfree relies on (tests/integrations/test_seams.py lists and checks each):

- a model's attention backend, `config._attn_implementation`, and its experts backend, `_experts_implementation`;
- `ALL_ATTENTION_FUNCTIONS`, whose entry for a backend the architecture check counts calls of;
- `AttentionMaskInterface._global_mapping`, which `create_causal_mask` reads first: a backend not in it gets no mask
  built (and no packed-sequence detection, a host sync per forward);
- the mixer kernel wrappers of `integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`, whose closure says
  what a call runs, and which stand-ins and PyTorch fallbacks are swapped into;
- the module-level weak reference to the DeepSpeed config `from_pretrained` builds under;
- the auto-model name mappings (`trl-padfree models`) and `_no_split_modules` (the planner);
- `ProcessorMixin._get_num_multimodal_tokens`, each image's placeholder tokens from its height and width, for the
  processors whose `replace_image_token` writes the placeholder that many times (packing/pair_sizes.py).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import swapped, swapped_item

# ---- attention backends ----


def attn_implementation(model) -> str | None:
    """The attention backend `model`'s language model (or a config's) runs: the whole model's for a text model."""
    config = getattr(model, "config", model)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text_config._attn_implementation


def set_language_model_attention(model, attn_implementation: str) -> None:
    """Switch `model`'s language model to `attn_implementation`. A multimodal model's other towers (vision, audio)
    keep theirs: they attend within each image or clip on their own terms, and the packed row's keyword arguments
    are not theirs to read."""
    config = model.config
    text_config = config.get_text_config()
    text_key = next((key for key in config.sub_configs if getattr(config, key, None) is text_config), None)
    if text_config is config or text_key is None:
        model.set_attn_implementation(attn_implementation)
    else:
        model.set_attn_implementation({text_key: attn_implementation})


def label_top_level_attention(config, attn_implementation: str) -> None:
    """Name `attn_implementation` on a multimodal config's top level only, its sub-configs (the towers, the language
    model) keeping theirs: DeepSpeed's Ulysses checks the backend it wraps against the top-level name, which for a
    vision-language model otherwise names the vision tower's."""
    config._attn_implementation = {"": attn_implementation}


def set_config_implementations(config, attn_implementation: str, experts_implementation: str | None = None) -> None:
    """Set a config's attention backend (and its experts backend, where the config has one) before a model is built
    from it."""
    config._attn_implementation = attn_implementation
    if experts_implementation is not None and hasattr(config, "_experts_implementation"):
        config._experts_implementation = experts_implementation


def register_attention(name: str, attention: Callable, mask: Callable) -> None:
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)


@contextlib.contextmanager
def mask_creation_skipped(name: str) -> Iterator[None]:
    """Around a packed forward on the registered backend `name`, which reads its row's segments itself: transformers
    builds no mask for it. `create_causal_mask` exits early for a backend whose mask function is not registered, before
    it reads `position_ids` to find packed sequences (a host sync per forward); the mask function, which only refuses a
    padding mask, has nothing to refuse in a packed row, whose forward passes none."""
    mapping = AttentionMaskInterface._global_mapping
    if name not in mapping:
        yield
        return
    mask = mapping.pop(name)
    try:
        yield
    finally:
        mapping[name] = mask


class AttentionCalls:
    calls = 0


@contextlib.contextmanager
def attention_calls_observed(attn_implementation: str, observe: Callable[..., None]) -> Iterator[bool]:
    """`observe(*args, **kwargs)` before every call of a registered attention function, with the call's arguments;
    yields False (observing nothing) for a backend that is the model's own code (eager)."""
    if attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        yield False
        return
    function = ALL_ATTENTION_FUNCTIONS[attn_implementation]

    @functools.wraps(function)
    def observed(*args, **kwargs):
        observe(*args, **kwargs)
        return function(*args, **kwargs)

    with swapped_item(ALL_ATTENTION_FUNCTIONS, attn_implementation, observed):
        yield True


@contextlib.contextmanager
def attention_calls_counted(attn_implementation: str) -> Iterator[AttentionCalls | None]:
    """Count the calls of a registered attention function (to see that a model really runs it); None for a backend
    that is the model's own code (eager), which cannot be counted."""
    counter = AttentionCalls()

    def count(*args, **kwargs):
        counter.calls += 1

    with attention_calls_observed(attn_implementation, count) as observed:
        yield counter if observed else None


# ---- mixer kernels: transformers' kernel-hub wrappers ----
#
# Each mixer kernel is a module-level PyTorch function decorated with `use_kernel_func_from_hub_with_fallback(
# func_name, package)`, which resolves at import the package's implementation (or the PyTorch function) and returns a
# wrapper that passes on only the keywords the implementation names. The wrapper's closure holds what it resolved.
# With the `kernels` package installed (a dependency of transformers >= 5.25), the decorator also turns the wrapper
# into a `kernels` function module: an `nn.Module` instance whose class's `forward` calls the wrapper (`func` in its
# closure) and whose class carries the hub name (`kernel_layer_name`). A mixer's forward may reach its kernels through
# such a module around a helper of its own module (5.25: `causal_conv1d_forward`, which calls `causal_conv1d_fn`).

_WRAPPER_CLOSURE = ("implementation", "is_new_implementation", "func_name", "package", "torch_function")


@dataclass(frozen=True)
class KernelWrapper:
    """What a transformers kernel wrapper resolved."""

    name: str  # transformers' kernel-hub name (`causal_conv1d_fn`, ...)
    package: str  # the import package it looks for the kernel in
    implementation: Callable  # what a call runs
    is_fallback: bool  # transformers' own PyTorch function (the package is not installed)
    torch_function: Callable  # that PyTorch function
    # The device types the implementation is handed inputs on (others run `torch_function`); None: every device
    # (transformers < 5.25, or a package it lists no devices for)
    devices: tuple[str, ...] | None = None

    def runs_on(self, device_type: str) -> bool:
        """Whether a call with inputs on `device_type` runs `implementation` (not transformers' PyTorch function)."""
        return not self.is_fallback and (self.devices is None or device_type in self.devices)


def _closure(function) -> dict:
    if not isinstance(function, types.FunctionType) or function.__closure__ is None:
        return {}
    cells = (cell.cell_contents for cell in function.__closure__)
    return dict(zip(function.__code__.co_freevars, cells, strict=True))


def hub_function(value) -> Callable | None:
    """The function a `kernels` function module calls (`value` an instance of the module class `kernels` makes of a
    decorated function); None for anything else."""
    forward = getattr(type(value), "forward", None)
    if not hasattr(type(value), "kernel_layer_name") or forward is None:
        return None
    function = _closure(forward).get("func")
    return function if callable(function) else None


def hub_kernel_name(value) -> str | None:
    """The kernel-hub name `value` was decorated with (a transformers wrapper or a `kernels` function module), read
    without its closure: what a mixer's module defines even where the wrapper's layout moved."""
    name = getattr(type(value), "kernel_layer_name", None)
    if isinstance(name, str):
        return name
    return _closure(value).get("func_name") if isinstance(value, types.FunctionType) else None


def kernel_wrapper(function) -> KernelWrapper | None:
    """What `function` resolves to, if it is a transformers kernel wrapper (bare, or inside a `kernels` function
    module); else None."""
    inner = hub_function(function)
    closure = _closure(function if inner is None else inner)
    if not set(_WRAPPER_CLOSURE) <= set(closure):
        return None
    devices = closure.get("supported_devices")
    return KernelWrapper(
        name=closure["func_name"],
        package=closure["package"],
        implementation=closure["implementation"],
        is_fallback=not closure["is_new_implementation"],
        torch_function=closure["torch_function"],
        devices=tuple(devices) if devices is not None else None,
    )


def rewrapped(wrapper, implementation: Callable):
    """A wrapper like `wrapper`, built by transformers' own decorator, that resolves to `implementation` on inputs of
    any device (a stand-in plays a GPU kernel on CPU tensors): the decorator imports the kernel's package, here a
    module holding only that function, and is told no device list for it."""
    from transformers.integrations import hub_kernels
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    resolved = kernel_wrapper(wrapper)
    package = types.ModuleType(resolved.package)
    setattr(package, resolved.name, implementation)
    previous = sys.modules.get(resolved.package)
    sys.modules[resolved.package] = package
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {})  # transformers >= 5.25
    listed = devices.pop(resolved.package, None)
    try:
        rebuilt = use_kernel_func_from_hub_with_fallback(resolved.name, resolved.package)(resolved.torch_function)
    finally:
        if listed is not None:
            devices[resolved.package] = listed
        if previous is None:
            del sys.modules[resolved.package]
        else:
            sys.modules[resolved.package] = previous
    if kernel_wrapper(rebuilt).implementation is not implementation or kernel_wrapper(rebuilt).devices is not None:
        raise RuntimeError(f"transformers did not resolve `{resolved.name}` to the function it was given")
    return rebuilt


def _calls(function, module: types.ModuleType, seen: set[str]) -> Iterator[tuple[str, object]]:
    """The module-level names of `module` that `function` calls, and through the module's own helpers (plain
    functions, or `kernels` function modules around them) the names they call."""
    import inspect

    code = getattr(inspect.unwrap(function), "__code__", None)
    for name in code.co_names if code is not None else ():
        if name in seen:
            continue
        seen.add(name)
        value = getattr(module, name, None)
        yield name, value
        helper = value if kernel_wrapper(value) is None else None
        helper = hub_function(helper) or helper
        if isinstance(helper, types.FunctionType) and helper.__module__ == module.__name__:
            yield from _calls(helper, module, seen)


def kernel_wrappers_called(cls: type) -> tuple[KernelWrapper, ...]:
    """The kernel wrappers `cls.forward` calls: module-level names of its module that are wrappers, called by the
    forward or by the module's own helpers it calls."""
    module = sys.modules.get(cls.__module__)
    if module is None:
        return ()
    resolved = (kernel_wrapper(value) for _, value in _calls(cls.forward, module, set()))
    return tuple(wrapper for wrapper in resolved if wrapper is not None)


def kernel_names_called(cls: type) -> frozenset[str]:
    """The kernel-hub names of what `cls.forward` calls (directly or through its module's helpers), read from the
    decorated objects' names alone: the kernels a mixer uses even where transformers moved what their closures hold."""
    module = sys.modules.get(cls.__module__)
    if module is None:
        return frozenset()
    names = (hub_kernel_name(value) for _, value in _calls(cls.forward, module, set()))
    return frozenset(name for name in names if name is not None)


def kernelized_functions(module: object) -> list[str]:
    """The kernel functions `kernels.kernelize` replaced on `module` (a layer decorated with `use_kernelized_func`
    keeps one private function module per kernel, whose forward kernelize swaps for the hub kernel's)."""
    private = vars(module).get("_kernel_funcs") or {}
    return sorted(name for name, function in private.items() if "forward" in vars(function))


@contextlib.contextmanager
def kernel_wrappers_replaced(replacement: Callable[[KernelWrapper, dict[str, Callable]], Callable | None]):
    """Every imported transformers model module's kernel wrappers resolved to `replacement(wrapper, fallbacks)`
    (given what the wrapper resolved and that module's PyTorch fallbacks by hub name; None keeps it), restored on
    exit."""
    with contextlib.ExitStack() as swaps:
        for module in [
            module for name, module in list(sys.modules.items()) if name.startswith("transformers.models.")
        ]:
            wrappers = {}
            for attribute, value in list(vars(module).items()):
                resolved = kernel_wrapper(value)
                if resolved is not None:
                    wrappers[attribute] = (value, resolved)
            fallbacks = {resolved.name: resolved.torch_function for _, resolved in wrappers.values()}
            for attribute, (wrapper, resolved) in wrappers.items():
                implementation = replacement(resolved, fallbacks)
                if implementation is not None:
                    swaps.enter_context(swapped(module, attribute, rewrapped(wrapper, implementation)))
        yield


# ---- the DeepSpeed config transformers builds models under ----


def modeling_modules_imported(config) -> None:
    """Import the modeling module of `config`'s model type and of each of its sub-configs' (a vision-language model's
    language model and tower), as building the model would, before DeepSpeed's `zero.Init` first runs.

    `zero.Init` wraps the `__init__` of every `nn.Module` class created while it is active, before the class's
    decorators run, and on exit puts back the `__init__` it saw: a class first imported inside it (a composite model
    imports its parts' modules when its constructor builds them) loses what a decorator added to its `__init__`.
    transformers 5.24's `use_experts_implementation` sets `self.config` there, so every later instance (the reference
    model built under the next `zero.Init`, the architecture check's twin) fails in its forward with "'...Experts'
    object has no attribute 'config'" (DeepSpeed 0.19.8; Kimi K2.5's DeepSeek-V3 experts)."""
    names = base_model_class_names()
    pending = [config]
    while pending:
        current = pending.pop()
        name = names.get(current.model_type)
        if isinstance(name, str):  # (a few types map to several classes: not composite models' parts)
            getattr(transformers, name, None)  # transformers imports a class's module on first access
        sub_configs = [getattr(current, key, None) for key in getattr(current, "sub_configs", {})]
        pending += [sub_config for sub_config in sub_configs if sub_config is not None]


@contextlib.contextmanager
def without_deepspeed_zero3() -> Iterator[None]:
    """Models built in the block are whole: no DeepSpeed config is registered with transformers while it runs, and
    the trainer's comes back after. A composite model (a vision-language model) builds its parts with `from_config`
    inside its own constructor, which under a registered ZeRO-3 config partitions them with collectives."""
    from transformers.integrations import deepspeed as hf_deepspeed

    with deepspeed_config_restored():
        hf_deepspeed.unset_hf_deepspeed_config()
        yield


@contextlib.contextmanager
def deepspeed_config_restored() -> Iterator[None]:
    """Building a transformers DeepSpeed config registers it globally (a module-level weak reference that every new
    `HfDeepSpeedConfig` overwrites): put the previous one back after the block."""
    from transformers.integrations import deepspeed as hf_deepspeed

    previous_ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    previous = previous_ref() if previous_ref is not None else None
    try:
        yield
    finally:
        if previous is not None:
            hf_deepspeed.set_hf_deepspeed_config(previous)
        else:
            hf_deepspeed.unset_hf_deepspeed_config()


# ---- model names and structure ----


def causal_lm_class_names() -> dict[str, str]:
    """Model type -> the class `AutoModelForCausalLM` builds."""
    from transformers.models.auto import modeling_auto

    return dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def image_text_to_text_class_names() -> dict[str, str]:
    """Model type -> the class `AutoModelForImageTextToText` builds (TRL's vision-language DPO loads these)."""
    from transformers.models.auto import modeling_auto

    return dict(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def base_model_class_names() -> dict[str, str]:
    """Model type -> the class `AutoModel` builds (a vision-language model's inner model, which holds its
    `get_rope_index` where it has one)."""
    from transformers.models.auto import modeling_auto

    return dict(modeling_auto.MODEL_MAPPING_NAMES)


def not_decoder_only_types() -> set[str]:
    """Types AutoModelForCausalLM maps that are not decoder-only LMs: encoders used as decoders, and decoders of
    encoder-decoder models."""
    from transformers.models.auto import modeling_auto

    return (
        set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
        | set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
        | set(modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
    )


def no_split_modules(model) -> list[str]:
    """The layer classes transformers (and accelerate's FSDP2 wrap policy) keep whole: the decoder layers."""
    return list(getattr(model, "_no_split_modules", None) or [])


# Processors whose `replace_image_token` is `image_token * n`, n what `_get_num_multimodal_tokens` computes from the
# image's size (Qwen-VL: its resized grid's merged patches; LLaVA: a fixed count from the crop size). Others write
# text around their tokens (Gemma 3, LLaVA-NeXT's rows, tiles) and are collated.
_PLACEHOLDER_REPEATING_PROCESSORS = (
    "transformers.models.qwen2_vl.processing_qwen2_vl.Qwen2VLProcessor",
    "transformers.models.qwen2_5_vl.processing_qwen2_5_vl.Qwen2_5_VLProcessor",
    "transformers.models.qwen3_vl.processing_qwen3_vl.Qwen3VLProcessor",
    "transformers.models.llava.processing_llava.LlavaProcessor",
)


def counts_image_tokens_from_sizes(processor) -> bool:
    """Whether `image_token_counts` gives `processor`'s image tokens (a subclass of one of those processors)."""
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(processor).__mro__}
    return not names.isdisjoint(_PLACEHOLDER_REPEATING_PROCESSORS) and hasattr(processor, "image_token_id")


def image_token_counts(processor, sizes: list[tuple[int, int]]) -> list[int]:
    """Each image's placeholder tokens, from its (height, width), with the processor's own settings."""
    if not sizes:
        return []
    return list(processor._get_num_multimodal_tokens(image_sizes=[list(size) for size in sizes]).num_image_tokens)
