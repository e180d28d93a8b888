"""`trl-padfree configs`: the configs shipped in the package, for a launch of one's own.

    trl-padfree configs                      # list them: DPO configs and accelerate configs, each with its first line
    trl-padfree configs show zero3           # print one (a DPO config or an accelerate config, by name)
    trl-padfree configs copy zero3 my.yaml   # copy one to edit (DEST: a file or a folder; default ./<name>.yaml)

Each file starts with a comment saying what it is for and the `trl-padfree dpo` command that uses it; the listing shows
that comment's first sentence.
"""

from __future__ import annotations

import argparse
import shutil
import textwrap
from pathlib import Path

from trl_padfree.cli.launch import shipped_configs

# Each kind of shipped config: its folder in trl_padfree/cli/, and how it is used
KINDS = {
    "configs": "DPO configs: trl-padfree dpo --config NAME",
    "accelerate_configs": "accelerate configs: trl-padfree dpo --accelerate_config NAME, or accelerate launch "
    "--config_file FILE",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(
        dest="action", metavar="{show,copy}", help="without one: list the shipped configs", parser_class=type(parser)
    )
    show = actions.add_parser("show", help="print a shipped config", description="Print a shipped config.")
    show.add_argument("name", help="a shipped config's name (`trl-padfree configs` lists them)")
    copy = actions.add_parser(
        "copy", help="copy a shipped config, to edit or launch with", description="Copy a shipped config."
    )
    copy.add_argument("name", help="a shipped config's name (`trl-padfree configs` lists them)")
    copy.add_argument(
        "dest", nargs="?", default=".", help="a file, or a folder to copy it into as NAME.yaml (default: .)"
    )
    parser.set_defaults(run=run)


def run(options: argparse.Namespace) -> int:
    if options.action == "show":
        print(shipped_config(options.name).read_text(), end="")
    elif options.action == "copy":
        source = shipped_config(options.name)
        print(f"Copied {source.name} to {copy_config(source, Path(options.dest))}")
    else:
        print(listing(shutil.get_terminal_size().columns))
    return 0


def shipped_config(name: str) -> Path:
    """The shipped config `name` (with or without `.yaml`), of either kind: no name is shared between the kinds."""
    every = {stem: path for kind in KINDS for stem, path in shipped_configs(kind).items()}
    path = every.get(name.removesuffix(".yaml"))
    if path is None:
        raise ValueError(f"No shipped config named {name!r}. Shipped: {', '.join(every)}.")
    return path


def copy_config(source: Path, dest: Path) -> Path:
    """Copy `source` to `dest` (a file, or a folder to copy it into); an existing file is left alone."""
    target = dest / source.name if dest.is_dir() else dest
    if target.exists():
        raise FileExistsError(f"{target} exists: name another destination, or remove it first.")
    shutil.copyfile(source, target)
    return target


def description(path: Path) -> str:
    """The first sentence of the comment a shipped config starts with (up to its command line, `#   trl-padfree`)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("# "):
            break
        lines.append(line[2:])
    header = " ".join(lines).split("   trl-padfree", 1)[0].strip()
    first = header.split(". ", 1)[0]
    return first if first.endswith(".") else first + "."


def listing(columns: int = 100) -> str:
    """Every shipped config by kind, with its folder and description."""
    out = []
    for kind, usage in KINDS.items():
        configs = shipped_configs(kind)
        folder = next(iter(configs.values())).parent
        out.append(f"{usage} (in {folder}):")
        width = max(map(len, configs)) + 4
        for name, path in configs.items():
            indent = " " * width
            out.append(
                textwrap.fill(
                    description(path),
                    max(columns, width + 40),
                    initial_indent=f"  {name}".ljust(width),
                    subsequent_indent=indent,
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
        out.append("")
    out.append("trl-padfree configs show NAME prints one; trl-padfree configs copy NAME [DEST] copies it to edit.")
    return "\n".join(out)
