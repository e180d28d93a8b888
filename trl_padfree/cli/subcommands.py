"""The `trl-padfree` parser and entry point: each subcommand's module is imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from .exits import OneLineErrorParser, one_line_errors

# Each subcommand: the module that adds its arguments and runs it, its one-line help, its description
SUBCOMMANDS = {
    "dpo": (
        "trl_padfree.cli.dpo",
        "train with padding-free DPO: TRL's `trl dpo` (its arguments, --config YAML, accelerate launch options)",
        "TRL's DPO script with padding-free DPO, launched through `accelerate launch`. --config takes a YAML file or "
        "the name of a shipped config, --accelerate_config an accelerate config file or the name of a shipped one; "
        "options that are no training argument go to `accelerate launch`.",
    ),
    "configs": (
        "trl_padfree.cli.configs_command",
        "list the shipped DPO and accelerate configs; print one (show NAME) or copy it (copy NAME [DEST])",
        "The configs shipped in the package: without an action, each DPO config (--config NAME) and accelerate "
        "config (--accelerate_config NAME) with what it is for and its folder; `show NAME` prints one, `copy NAME "
        "[DEST]` copies it, to edit or to pass to your own `accelerate launch --config_file`.",
    ),
    "demo": (
        "trl_padfree.cli.demo",
        "train a small model padded and padding-free on the shipped data, on CPU, and compare",
        "Train a demo model with padded TRL and with padding-free DPO on the same batches (shipped data, no download), "
        "then report the padding removed, tokens/s and both losses.",
    ),
    "bench": (
        "trl_padfree.cli.bench",
        "time padded vs padding-free DPO training steps on the same batches",
        "Time full DPO training steps (reference forward, policy forward and backward) of padded TRL and of "
        "padding-free mode with each attention backend, on the same batches, alternating the modes.",
    ),
    "plan": (
        "trl_padfree.plan",
        "estimate GPU and CPU memory of a DPO run (policy, reference, activations) and the cheapest fix",
        "Estimate per-GPU and per-node CPU memory of a DPO run from the model's config alone: policy states "
        "(DeepSpeed's estimators, or FSDP2's shards with --fsdp2), the reference model, an activation estimate; say "
        "whether it fits and the cheapest change that makes it fit. See docs/concepts/memory-planning.md.",
    ),
    "models": (
        "trl_padfree.cli.models",
        "which architectures pack exactly, per attention backend (checked on tiny twins, no download)",
        "Check every decoder-only causal-LM type of the installed transformers, or one model's config.json with "
        "--check, on tiny float64 twins: packed forward and backward against each sequence alone. See "
        "docs/reference/models.md.",
    ),
    "balance": (
        "trl_padfree.cli.balance",
        "simulate how much data-parallel processes wait for the slowest row, dealt as usual or balanced by cost",
        "Simulate optimizer steps of pairs (the bench's length models or a local dataset) over many data-parallel "
        "processes: the expected slowest row over the mean row, with pairs dealt as usual and balanced by their FLOPs "
        "(LPT per micro-step), and the step-time gain. No model or GPU needed. See docs/concepts/balancing.md.",
    ),
}


# Subcommands whose own parser reads everything after their name, --help included: `dpo` parses TRL's dataclasses
# and hands what they do not read to `accelerate launch`, as `trl dpo` does
READS_ITS_OWN_ARGUMENTS = {"dpo"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the arguments of `command` (its module imported); the others list only their help."""
    parser = OneLineErrorParser(prog="trl-padfree", description="Padding-free DPO for TRL.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    for name, (module, help_line, description) in SUBCOMMANDS.items():
        add_help = name not in READS_ITS_OWN_ARGUMENTS
        subparser = commands.add_parser(name, help=help_line, description=description, add_help=add_help)
        if name == command:
            importlib.import_module(module).add_arguments(subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    # TRL 1.16 still calls transformers 5's deprecated `gradient_checkpointing` names: nothing a user can act on
    warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6", category=FutureWarning)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((argument for argument in argv if not argument.startswith("-")), None)
    parser = build_parser(command)
    options, unknown = parser.parse_known_args(argv)
    if options.command in READS_ITS_OWN_ARGUMENTS:
        options.arguments = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    with one_line_errors(f"trl-padfree {options.command}"):
        return options.run(options)
