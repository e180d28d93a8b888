"""A command's `--help` text, rendered once per set of versions and read back from the user's cache.

Rendering a parser built from TRL's and transformers' configs means importing them (seconds); reading the text back
takes milliseconds. Each text is a file named by a digest of its key (the versions and sources it depends on), so a
text is only ever read back for exactly what rendered it:

    $TRL_PADFREE_CACHE/help/dpo-<digest of the key>.txt

`TRL_PADFREE_CACHE` defaults to `$XDG_CACHE_HOME/trl_padfree`, else `~/.cache/trl_padfree`. A cache that cannot be
read or written costs only time: the text is rendered, and stderr says why it was not kept and how to fix it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def cache_folder() -> Path:
    """`$TRL_PADFREE_CACHE`, else `$XDG_CACHE_HOME/trl_padfree`, else `~/.cache/trl_padfree`."""
    if "TRL_PADFREE_CACHE" in os.environ:
        return Path(os.environ["TRL_PADFREE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trl_padfree"


def sources_digest() -> str:
    """A digest of trl-padfree's Python sources and the names of all its files (the shipped configs are listed by
    name): an editable install keeps its version while its sources change."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(path.relative_to(PACKAGE_ROOT).as_posix().encode() + b"\0")
            if path.suffix == ".py":
                digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def cached_help(command: str, key: dict[str, str], render: Callable[[], str]) -> str:
    """The text `render()` returns for `key`: read from the cache, or rendered and written there for the next call.

    Args:
        command (`str`):
            The subcommand, the first part of the file's name.
        key (`dict[str, str]`):
            Everything the text depends on (library versions, Python, a digest of the sources).
        render (`Callable[[], str]`):
            Renders the text live; called only when the cache has none for `key`.
    """
    encoded_key = json.dumps(key, sort_keys=True).encode()
    path = cache_folder() / "help" / f"{command}-{hashlib.sha256(encoded_key).hexdigest()[:32]}.txt"
    try:
        return path.read_bytes().decode("utf-8")
    except OSError:  # none yet, or a cache folder that cannot be read: render it
        pass
    text = render()
    try:
        _write_atomically(path, text)
    except OSError as error:
        print(
            f"trl-padfree {command}: the help could not be cached in {path.parent} ({error}), so each --help renders "
            "it again (seconds). Set TRL_PADFREE_CACHE to a writable folder.",
            file=sys.stderr,
        )
    return text


def _write_atomically(path: Path, text: str) -> None:
    # A reader sees the whole text or no file: written beside its place, then renamed over it
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(text.encode("utf-8"))
        os.chmod(temporary, 0o644)  # mkstemp's 0o600 would keep a shared cache's text from its other users
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
