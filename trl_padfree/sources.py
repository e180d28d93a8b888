"""Where recipes get models and datasets: hub names and local paths as TRL takes them, plus the shipped defaults.

`trl-padfree/<size>-<type>` names a demo model built from a config (saved once to a local cache, then loaded by
path like any checkpoint, so the reference model is reloaded the way TRL reloads a hub model), and
`trl-padfree/demo-preferences` the preference data shipped in the package. Nothing here downloads anything itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from datasets import DatasetDict, IterableDatasetDict, load_dataset

from .data import DEMO_DATASET_NAME, load_demo_dataset, load_demo_tokenizer
from .placement.deepspeed import zero3_init_config
from .tiny import is_demo_model_name, make_demo_model, parse_demo_model_name

DATA_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def cache_dir() -> Path:
    return Path(os.environ.get("TRL_PADFREE_CACHE", Path.home() / ".cache" / "trl_padfree"))


def _looks_like_path(name: str) -> bool:
    # Hub ids are `name` or `owner/name`; these can only be meant as local paths
    return name.startswith((".", "/", "~"))


def resolve_model(name_or_path: str) -> str:
    """A demo model name becomes the local directory it is saved in (built on first use); anything else is returned
    unchanged for `from_pretrained`."""
    if not is_demo_model_name(name_or_path):
        if _looks_like_path(name_or_path) and not Path(name_or_path).expanduser().is_dir():
            raise FileNotFoundError(f"Model folder {name_or_path!r} does not exist.")
        return name_or_path
    size, model_type = parse_demo_model_name(name_or_path)
    directory = cache_dir() / f"{size}-{model_type}"
    if not (directory / "config.json").exists():
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # transformers writes a model from global rank 0 only; the others wait for it (one shared cache)
            if torch.distributed.get_rank() == 0:
                _save_atomically(directory, lambda path: _save_demo_model(size, model_type, path))
            torch.distributed.barrier()
        else:
            _save_atomically(directory, lambda path: _save_demo_model(size, model_type, path))
    return str(directory)


def load_model_config(name_or_path: str, trust_remote_code: bool = False, what: str = "model folder or config.json"):
    """The config of a local model folder or config.json, or else of the hub model of that name (its config.json
    only). A name that is none of them stops with one line naming it and why (`what`: the local things the command
    takes)."""
    from transformers import AutoConfig

    path = Path(name_or_path).expanduser()
    if _looks_like_path(name_or_path) and not path.exists():
        raise FileNotFoundError(f"{name_or_path!r} is no {what}: there is no such folder or file.")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{name_or_path!r} is no {what}: the folder holds no config.json.")
    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except OSError as error:
        if path.exists():
            raise OSError(f"{name_or_path!r} is no {what}: {error}") from error
        raise OSError(
            f"{name_or_path!r} is no {what} here, and the hub's config of that name cannot be read: {error}"
        ) from error


def _save_demo_model(size: str, model_type: str, path: Path) -> None:
    # Built whole even under a ZeRO-3 launch, whose `zero.Init` would otherwise shard it before it is saved
    with zero3_init_config(None):
        model = make_demo_model(size, model_type)
    model.save_pretrained(path)
    load_demo_tokenizer().save_pretrained(path)


def _save_atomically(directory: Path, save) -> None:
    # Several processes (`accelerate launch`) may build the same model at once: each writes its own copy, one wins
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}-"))
    try:
        save(staging)
        os.rename(staging, directory)
    except OSError:
        if not (directory / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_preference_dataset(
    name_or_path: str, config_name: str | None = None, streaming: bool = False
) -> DatasetDict | IterableDatasetDict:
    """The shipped demo data, a local data file or folder, or a hub dataset, as a `DatasetDict`; with `streaming`
    (TRL's `dataset_streaming`), read as it is iterated, an `IterableDatasetDict`."""
    if name_or_path == DEMO_DATASET_NAME:
        return load_demo_dataset(streaming=streaming)
    path = Path(name_or_path).expanduser()
    if path.suffix in DATA_FILE_FORMATS:
        if not path.is_file():
            raise FileNotFoundError(f"Dataset file {str(path)!r} does not exist.")
        return load_dataset(DATA_FILE_FORMATS[path.suffix], data_files=str(path), streaming=streaming)
    if path.is_dir() or _looks_like_path(name_or_path):
        if not path.is_dir():
            raise FileNotFoundError(f"Dataset folder {str(path)!r} does not exist.")
        return load_dataset(str(path), name=config_name, streaming=streaming)
    return load_dataset(name_or_path, name=config_name, streaming=streaming)
