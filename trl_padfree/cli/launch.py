"""The configs shipped in the package, found by name, and `accelerate launch` of a training module, as TRL's `trl dpo`
launches its script.

    trl_padfree/cli/configs/<name>.yaml              DPO recipes: `--config <name>`
    trl_padfree/cli/accelerate_configs/<name>.yaml   accelerate configs: `--accelerate_config <name>`

A value that names an existing file is that file; otherwise a shipped config of that name (no `.yaml`).
"""

from __future__ import annotations

import subprocess
from importlib import resources
from pathlib import Path

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


def launch_module(module: str, launch_args: list[str], module_args: list[str]) -> int:
    """`accelerate launch LAUNCH_ARGS -m MODULE MODULE_ARGS`; returns the exit status of the processes.

    A bad launch option is one line, like ours. A process that fails has printed its own error: the status is passed
    on without a traceback of the launcher around it."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = one_line_usage_errors(launch_command_parser())
    parser.prog = "trl-padfree dpo (accelerate launch options)"
    options = parser.parse_args([*launch_args, "--module", module, *module_args])
    try:
        launch_command(options)
    except subprocess.CalledProcessError as error:  # the single-process launcher
        return error.returncode or 1
    except ChildFailedError as error:  # torchrun's, under every multi-process launcher
        return next(iter(error.failures.values())).exitcode or 1
    return 0
