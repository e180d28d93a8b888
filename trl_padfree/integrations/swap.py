"""The one way this package swaps a library's attribute or registry entry for a while: `swapped` / `swapped_item`,
which check that the swap took effect, and, where asked, that the library really went through it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

_MISSING = object()


class Use:
    """How often a swapped-in function was called while the swap held (`calls`)."""

    def __init__(self) -> None:
        self.calls = 0


def _counted(replacement: Callable, use: Use) -> Callable:
    @functools.wraps(replacement)
    def counted(*args, **kwargs):
        use.calls += 1
        return replacement(*args, **kwargs)

    return counted


@contextlib.contextmanager
def swapped(owner: Any, name: str, replacement: Any, *, must_be_used: str | None = None) -> Iterator[Use]:
    """`owner.<name>` is `replacement` within the block, and what it was after (an instance attribute that only
    shadowed its class's is removed again).

    Checked: right after the swap, `owner.<name>` must be `replacement`; with `must_be_used` (what the library would
    then not do, for the error), the block must have called it at least once, or the library no longer goes through
    that name and the swap did nothing."""
    use = Use()
    if must_be_used is not None:
        replacement = _counted(replacement, use)
    own = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name)
    setattr(owner, name, replacement)
    if getattr(owner, name) is not replacement:
        raise RuntimeError(f"{owner!r}.{name} did not take the replacement: it is read-only or computed.")
    completed = False
    try:
        yield use
        completed = True
    finally:
        if own is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, own)
    if completed and must_be_used is not None and use.calls == 0:
        raise RuntimeError(
            f"`{getattr(owner, '__name__', type(owner).__name__)}.{name}` was swapped but never called: {must_be_used}. "
            "The installed version no longer goes through it; pin the tested versions (pyproject.toml)."
        )


@contextlib.contextmanager
def swapped_item(mapping: MutableMapping, key: Any, replacement: Any) -> Iterator[None]:
    """`mapping[key]` is `replacement` within the block, and what it was after (checked to have taken)."""
    own = mapping[key]
    mapping[key] = replacement
    if mapping[key] is not replacement:
        raise RuntimeError(f"{type(mapping).__name__}[{key!r}] did not take the replacement.")
    try:
        yield
    finally:
        mapping[key] = own
