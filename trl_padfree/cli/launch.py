"""The configs shipped in the package, found by name, and `accelerate launch` of a training module, as TRL's `trl dpo`
launches its script.

    trl_padfree/cli/configs/<name>.yaml              DPO recipes: `--config <name>`
    trl_padfree/cli/accelerate_configs/<name>.yaml   accelerate configs: `--accelerate_config <name>`

A value that names an existing file is that file; otherwise a shipped config of that name (no `.yaml`). Where a run's
setting came from (the command line, the `--config` file, or neither: a default) is `setting_origins`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from .exits import one_line_usage_errors

CONFIG_KINDS = {"--config": "configs", "--accelerate_config": "accelerate_configs"}


def shipped_configs(kind: str) -> dict[str, Path]:
    """The shipped configs of `kind` ("configs" or "accelerate_configs"), by name."""
    folder = Path(str(resources.files("trl_padfree.cli").joinpath(kind)))
    return {path.stem: path for path in sorted(folder.glob("*.yaml"))}


def resolve_config(flag: str, value: str) -> str:
    """The file `value` names after `flag` (`--config` or `--accelerate_config`): a path, or a shipped config's name."""
    if Path(value).is_file():
        return value
    shipped = shipped_configs(CONFIG_KINDS[flag])
    if value.removesuffix(".yaml") in shipped:
        return str(shipped[value.removesuffix(".yaml")])
    raise FileNotFoundError(
        f"{flag} {value}: no such file, and no shipped config of that name (shipped: {', '.join(shipped)})."
    )


def resolve_config_arguments(argv: list[str]) -> list[str]:
    """`argv` with the value after `--config` and `--accelerate_config` made a file path."""
    resolved = list(argv)
    for index, argument in enumerate(argv):
        if argument in CONFIG_KINDS:
            if index + 1 == len(argv):
                raise ValueError(f"{argument} needs a value: a file or the name of a shipped config.")
            resolved[index + 1] = resolve_config(argument, argv[index + 1])
    return resolved


@dataclass(frozen=True)
class Origin:
    """Where a setting of a run came from: the command line, the `--config` file, or neither (a default). The
    command line wins over the file, as in TRL."""

    command_line: bool = False
    config: str | None = None  # the `--config` file that sets it

    @property
    def shipped_config(self) -> str | None:
        """The name of the shipped config that sets it, where one does."""
        if self.command_line or self.config is None:
            return None
        shipped = shipped_configs("configs").items()
        return next((name for name, path in shipped if Path(self.config).resolve() == path.resolve()), None)

    def __str__(self) -> str:
        if self.command_line:
            return "set on the command line"
        if self.config is not None:
            return f"set in the config {self.shipped_config or self.config}"
        return "a default"


def setting_origins(parser: argparse.ArgumentParser, argv: list[str], names: list[str]) -> dict[str, Origin]:
    """Where each setting of `names` came from in `argv` (its `--config` value a file, as `resolve_config_arguments`
    makes it), read by the `TrlParser` that parses `argv`, so an option's every spelling counts."""
    command_line, config, config_keys = list(argv), None, set()
    if "--config" in command_line:  # the first, as TRL reads it
        index = command_line.index("--config")
        config = command_line[index + 1]
        del command_line[index : index + 2]
        config_keys = set(yaml.safe_load(Path(config).read_text()) or {})
    unset = object()  # a value no option parses to: left where the command line does not set the option
    parsed, _ = parser.parse_known_args(command_line, namespace=argparse.Namespace(**dict.fromkeys(names, unset)))
    return {
        name: Origin(getattr(parsed, name) is not unset, config if name in config_keys else None) for name in names
    }


def accelerate_launch_arguments(launch_args: list[str]) -> list[str]:
    """`--accelerate_config FILE` becomes accelerate's own `--config_file FILE`; the other options stay."""
    if "--accelerate_config" not in launch_args:
        return launch_args
    index = launch_args.index("--accelerate_config")
    return ["--config_file", launch_args[index + 1], *launch_args[:index], *launch_args[index + 2 :]]


def unknown_launch_options(arguments: list[str]) -> list[str]:
    """The `--key value` pairs of `arguments` (a YAML's keys that no dataclass reads) that are no `accelerate launch`
    option."""
    from accelerate.commands.launch import launch_command_parser

    parser = one_line_usage_errors(launch_command_parser())
    unknown = []
    for key, value in zip(arguments[::2], arguments[1::2], strict=True):
        # An option takes its value (a flag leaves it to the script's place); anything else is returned unread
        if key != "--accelerate_config" and parser.parse_known_args([key, value, "script.py"])[1]:
            unknown += [key, value]
    return unknown


def launch_module(
    module: str, launch_args: list[str], module_args: list[str], environment: dict[str, str] | None = None
) -> int:
    """`accelerate launch LAUNCH_ARGS -m MODULE MODULE_ARGS`, `environment` added to the processes' variables; returns
    the exit status of the processes.

    A bad launch option is one line, like ours. A process that fails has printed its own error: the status is passed
    on without a traceback of the launcher around it."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = one_line_usage_errors(launch_command_parser())
    parser.prog = "trl-padfree dpo (accelerate launch options)"
    options = parser.parse_args([*launch_args, "--module", module, *module_args])
    try:
        with _environment(environment or {}):  # accelerate's launchers hand their own environment on
            launch_command(options)
    except subprocess.CalledProcessError as error:  # the single-process launcher
        return error.returncode or 1
    except ChildFailedError as error:  # torchrun's, under every multi-process launcher
        return next(iter(error.failures.values())).exitcode or 1
    return 0


@contextlib.contextmanager
def _environment(variables: dict[str, str]):
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
