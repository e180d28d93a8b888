"""Where recipes get models and datasets: hub names and local paths as TRL takes them, plus the shipped defaults.

`trl-padfree/<size>-<type>` names a demo model built from a config (saved once to a local cache, then loaded by
path like any checkpoint, so the reference model is reloaded the way TRL reloads a hub model), and
`trl-padfree/demo-preferences` the preference data shipped in the package. Nothing here downloads anything itself.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow
import pyarrow.json
import pyarrow.parquet
import torch
from datasets import DatasetDict, IterableDatasetDict, Value, load_dataset

from .data import DEMO_DATASET_NAME, load_demo_dataset, load_demo_tokenizer
from .data.preference_format import PAIR_COLUMNS, TEXT, value_kind
from .integrations.datasets import json_type_sample_bytes
from .placement.deepspeed import zero3_init_config
from .refusals.data import (
    check_data_file_has_rows,
    check_pair_columns,
    check_pair_value,
    refuse_unreadable_data_file,
)
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
    (TRL's `dataset_streaming`), read as it is iterated, an `IterableDatasetDict`.

    Each split records `name_or_path` as its `info.dataset_name`, so that an error in its rows names it. A local file
    that holds no row or cannot be read stops here, in one line naming the file.
    """
    if name_or_path == DEMO_DATASET_NAME:
        return _named(load_demo_dataset(streaming=streaming), DEMO_DATASET_NAME)
    path = Path(name_or_path).expanduser()
    if path.suffix in DATA_FILE_FORMATS:
        if not path.is_file():
            raise FileNotFoundError(f"Dataset file {str(path)!r} does not exist.")
        files = [path]
        load = functools.partial(load_dataset, DATA_FILE_FORMATS[path.suffix], data_files=str(path))
    elif path.is_dir() or _looks_like_path(name_or_path):
        if not path.is_dir():
            raise FileNotFoundError(f"Dataset folder {str(path)!r} does not exist.")
        files = sorted(file for file in path.rglob("*") if file.suffix in DATA_FILE_FORMATS and file.is_file())
        load = functools.partial(load_dataset, str(path), name=config_name)
    else:
        return _named(load_dataset(name_or_path, name=config_name, streaming=streaming), name_or_path)
    for file in files:
        _check_has_rows(file)
    try:
        dataset = load(streaming=streaming)
        if streaming:  # a stream reads nothing until iterated: its first rows here, so a bad file is named now
            for split in dataset.values():
                next(iter(split), None)
    except Exception as error:  # noqa: BLE001 - any failure to read a local file is named with the file
        for file in files:
            _check_readable(file)
        raise ValueError(f"Dataset {name_or_path!r} cannot be loaded: {type(error).__name__}: {error}") from error
    if not streaming:
        _check_rows_not_cast(files, next(iter(dataset.values())).features)
    return _named(dataset, name_or_path)


def _named(dataset: DatasetDict | IterableDatasetDict, name: str) -> DatasetDict | IterableDatasetDict:
    for split in dataset.values():
        split.info.dataset_name = name
    return dataset


def _check_has_rows(file: Path) -> None:
    """An empty data file, or one of blank lines only, read until its first character that is not blank."""
    size = file.stat().st_size
    has_text = size > 0
    if has_text and file.suffix != ".parquet":
        with file.open("rb") as handle:
            has_text = False
            while chunk := handle.read(1 << 16):
                if chunk.strip():
                    has_text = True
                    break
    check_data_file_has_rows(str(file), size, has_text)


def _check_readable(file: Path) -> None:
    """Where datasets failed to read a data file: the first line that is not JSON, or the reader's own complaint."""
    file_format = DATA_FILE_FORMATS[file.suffix]
    if file_format == "json":
        text = file.read_text(encoding="utf-8", errors="replace")
        try:
            json.loads(text)  # one JSON document (a .json file holding a list of rows)
            return
        except json.JSONDecodeError:
            pass
        lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        for row, (number, line) in enumerate(lines):
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                refuse_unreadable_data_file(str(file), "JSON Lines", f"line {number} is not JSON ({error})")
            if not isinstance(value, dict):
                refuse_unreadable_data_file(
                    str(file), "JSON Lines", f"line {number} is {type(value).__name__}, not a JSON object"
                )
            check_pair_columns(str(file), list(value), row)  # datasets 4 stops on a row that lacks a key
    elif file_format == "parquet":
        try:
            pyarrow.parquet.read_metadata(file)
        except pyarrow.ArrowException as error:
            refuse_unreadable_data_file(str(file), "Parquet", str(error))


def _check_rows_not_cast(files: list[Path], features) -> None:
    """datasets fixes a JSON file's column types from its first 10 MiB (and a folder's from its first file) and casts
    the rest to them: a 42 or a `false` in a later row of a string column becomes "42" or "false", which TRL would
    train on. Such files are read again by Arrow's JSON reader with those columns typed as strings, which refuses any
    other value; the row is then found line by line."""
    strings = [name for name in PAIR_COLUMNS if name in features and features[name] == Value("string")]
    for file in files:
        read_whole = len(files) == 1 and file.stat().st_size <= json_type_sample_bytes()
        if DATA_FILE_FORMATS[file.suffix] != "json" or not strings or read_whole:
            continue
        schema = pyarrow.schema([(name, pyarrow.string()) for name in strings])
        options = pyarrow.json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
        try:
            pyarrow.json.read_json(file, parse_options=options)
        except pyarrow.ArrowInvalid:
            _check_rows_are_strings(file, strings)


def _check_rows_are_strings(file: Path, columns: list[str]) -> None:
    rows = (line for line in file.read_text(encoding="utf-8").splitlines() if line.strip())
    for index, row in enumerate(map(json.loads, rows)):
        for column in columns:
            value = row.get(column)
            if value is not None and not isinstance(value, str):
                kind = value_kind(value)
                set_by = "the column's other rows are strings"
                check_pair_value(str(file), index, column, kind, (TEXT,), set_by, type(value).__name__)
