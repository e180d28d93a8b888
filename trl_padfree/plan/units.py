"""Units: parameter counts (34.4B, 7e9) and amounts of memory (80, 80GiB, 80GB) as the command line takes them."""

from __future__ import annotations

import re

GiB = 2**30
# Bytes per value of a training precision: weights, gradients and activations alike
BYTES_PER_PARAM = {"bf16": 2, "fp16": 2, "fp32": 4}
# The parameter-count suffixes: 34.4B, 500M. `B` is a billion here, as in model names, not bytes
COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
# A bare number is GiB: an "80 GB" GPU holds about 80 GiB (nvidia-smi: 81920 MiB on A100, 81559 MiB on H100)
MEMORY_UNITS = {
    "": GiB,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": GiB,
    "gib": GiB,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_NUMBER = re.compile(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_count(text: str) -> int:
    """A parameter count: `"34.4B"` -> 34_400_000_000, `"7e9"`, `"500M"`, `"1.5T"`, `"124000000"`."""
    match = _NUMBER.fullmatch(text)
    if match is None or match.group(2).lower() not in COUNT_SUFFIXES:
        raise ValueError(f"{text!r} is not a parameter count: write e.g. 34.4B, 7e9, 500M or 124000000.")
    return round(float(match.group(1)) * COUNT_SUFFIXES[match.group(2).lower()])


def parse_memory(text: str) -> int:
    """Bytes from `"80"` (GiB), `"80GiB"`, `"80GB"` (10**9 bytes), `"512G"` (GiB, like `free -g`), `"1.5TiB"`, ..."""
    match = _NUMBER.fullmatch(text)
    if match is None or match.group(2).lower() not in MEMORY_UNITS:
        raise ValueError(f"{text!r} is not an amount of memory: write e.g. 80 (GiB), 80GiB, 80GB or 1TiB.")
    return round(float(match.group(1)) * MEMORY_UNITS[match.group(2).lower()])


def gib(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / GiB:.1f}"
