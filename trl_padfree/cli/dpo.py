"""`trl-padfree dpo`: TRL's `trl dpo` with padding-free DPO. The same arguments (TRL's `ScriptArguments`, our
`DPOConfig`, `ModelConfig`, `DatasetMixtureConfig`) from the command line or a `--config` YAML, launched through
`accelerate launch`:

    trl-padfree dpo --config tiny_cpu                       # a shipped config by name, or a path to your own
    trl-padfree dpo --config llama3.1-8b_8gpu_fsdp2 --accelerate_config fsdp2 --num_processes 8
    accelerate launch --config_file my_accelerate.yaml -m trl_padfree.cli.dpo --config my_recipe.yaml

Arguments that are no field of those dataclasses go to `accelerate launch` (`--num_processes`, `--mixed_precision`,
...), and `--accelerate_config NAME|PATH` names an accelerate config: ours (`trl_padfree/cli/accelerate_configs/`) by
name, or a file. This module is also the training script each process runs (`python -m trl_padfree.cli.dpo`).

Besides what TRL takes, `model_name_or_path` takes a demo model built locally (`trl-padfree/<tiny|small|base>-<type>`),
and `dataset_name` the data shipped in the package (`trl-padfree/demo-preferences`) or a local data file. Unlike a
script's `trl_padfree.DPOConfig` (TRL's default, `padding_free=False`), the command trains padding-free unless told
otherwise (`--padding_free false`), and its first line says which mode trains.

`--help` renders the parser's text once per set of installed versions (importing TRL's and transformers' configs takes
seconds) and reads it back from the user's cache after that (help_cache.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib.metadata import version

from trl_padfree.cli.exits import exit_without_finalizing, one_line_errors, one_line_usage_errors
from trl_padfree.cli.help_cache import cached_help, sources_digest
from trl_padfree.cli.launch import (
    Origin,
    accelerate_launch_arguments,
    launch_module,
    resolve_config_arguments,
    setting_origins,
    shipped_configs,
    unknown_launch_options,
)

MODULE = "trl_padfree.cli.dpo"
# What the command trains unless the command line or the config says otherwise: padding-free, the reason to run it
COMMAND_DEFAULTS = {"padding_free": True}
# The settings whose origin (command line, config file, default) the run's messages name
NAMED_ORIGINS = ["padding_free", "dataset_name", "dataset_test_split", "eval_strategy"]
# Set by `trl-padfree dpo` for the processes it launches: it printed the run's first line, ahead of accelerate's warnings
FIRST_LINE_PRINTED = "TRL_PADFREE_DPO_FIRST_LINE_PRINTED"


def main(script_args, training_args, model_args, dataset_args, origins: dict[str, Origin] | None = None) -> int:
    """Train, save, and push to the Hub if asked; returns the number of processes the run used. `origins` (from
    `setting_origins`, by name) lets the messages say where a setting came from."""
    from trl import get_dataset, get_peft_config, get_quantization_config

    from trl_padfree.integrations.trl import ignore_boolean_buffers_in_ddp
    from trl_padfree.sources import load_preference_dataset, resolve_model
    from trl_padfree.trainer import DPOTrainer

    origins = origins or {}
    if training_args.process_index == 0 and not os.environ.get(FIRST_LINE_PRINTED):
        print(training_mode(training_args.padding_free, origins.get("padding_free")), flush=True)
    # The policy and the reference model are both loaded from these, as in TRL's script
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    if dataset_args.datasets:  # a mixture (`datasets:` in the YAML) wins over dataset_name, as in TRL's script
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_preference_dataset(
            script_args.dataset_name, script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ValueError(
            "Set `dataset_name` (a hub dataset, a local file, trl-padfree/demo-preferences) or `datasets`."
        )
    evaluate = evaluates(dataset, script_args, training_args, origins)

    trainer = DPOTrainer(
        model=resolve_model(model_args.model_name_or_path),
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if evaluate else None,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )
    if script_args.ignore_bias_buffers:  # as TRL's script does: DDP leaves the model's boolean buffers alone
        ignore_boolean_buffers_in_ddp(trainer.model)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"Model pushed to https://huggingface.co/{trainer.hub_model_id}")
    trainer.end()
    return trainer.accelerator.num_processes


def evaluates(dataset, script_args, training_args, origins: dict[str, Origin]) -> bool:
    """Whether the run evaluates, the splits it reads checked. A shipped config evaluates on its own data: on data the
    command line names, with no test split, its evaluation is turned off (`training_args` too), with a line saying so.
    Any other missing split stops the run with the way out."""
    from transformers.trainer_utils import IntervalStrategy

    name, splits = script_args.dataset_name or "the `datasets` mixture", list(dataset)
    train, test = script_args.dataset_train_split, script_args.dataset_test_split
    if train not in dataset:
        raise ValueError(
            f"The dataset has no split {train!r}; it has {splits} ({name}): name one with --dataset_train_split."
        )
    strategy = IntervalStrategy(training_args.eval_strategy)
    if strategy == IntervalStrategy.NO or test in dataset:
        return strategy != IntervalStrategy.NO
    set_by = origins.get("eval_strategy", Origin())
    data_set_by, test_set_by = origins.get("dataset_name", Origin()), origins.get("dataset_test_split", Origin())
    if set_by.shipped_config is None or not data_set_by.command_line or test_set_by.command_line:
        raise ValueError(
            f"The dataset has no split {test!r}; it has {splits} ({name}). eval_strategy {strategy.value!r} ({set_by}) "
            "evaluates on it: name one of its splits with --dataset_test_split, or train without evaluation: "
            "--eval_strategy no."
        )
    training_args.eval_strategy, training_args.do_eval = IntervalStrategy.NO, False
    if training_args.process_index == 0:
        print(
            f"trl-padfree dpo: evaluation off: {name} has no split {test!r} (it has {splits}), which the config "
            f"{set_by.shipped_config} evaluates on (eval_strategy: {strategy.value}). To evaluate, name one of its "
            "splits with --dataset_test_split, or give a folder holding train.jsonl and test.jsonl; --eval_strategy no "
            "turns it off without this line.",
            flush=True,
        )
    return False


def training_mode(padding_free: bool, origin: Origin | None = None) -> str:
    """The line a run starts with: which mode trains, and where `padding_free` was set (`origin`, where known)."""
    if origin is None:
        where = ""
    elif origin.command_line or origin.config is not None:
        where = f", {origin}"
    else:
        where = ", the command's default"
    if padding_free:
        return (
            f"trl-padfree dpo: padding-free training (padding_free=True{where}): each batch's pairs are packed into one "
            "row. --padding_free false trains on TRL's padded batches."
        )
    return f"trl-padfree dpo: padded training on TRL's batches (padding_free=False{where}; the command's default is True)."


def make_parser(prog: str = "trl-padfree dpo"):
    """TRL's DPO script's parser, with our `DPOConfig` and the command's defaults; bad flags are one line."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    from trl_padfree.config import DPOConfig

    epilog = (
        "Options that none of the above reads go to `accelerate launch` (--num_processes, --mixed_precision, "
        "--main_process_port, ...). --config takes a YAML file or a shipped config: "
        f"{', '.join(shipped_configs('configs'))}. --accelerate_config takes an accelerate config file or a shipped "
        f"one: {', '.join(shipped_configs('accelerate_configs'))}."
    )
    dataclass_types = (ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig)
    parser = TrlParser(dataclass_types, prog=prog, epilog=epilog)
    parser.set_defaults(**COMMAND_DEFAULTS)  # a config's values and the command line still override them
    return one_line_usage_errors(parser)


# ---------------------------------------------------------------------------------------------------------------------
# --help: TRL's and transformers' configs take seconds to import, so the text is rendered once per set of versions and
# read back from the user's cache

HELP_COLUMNS = 100  # one layout, whatever the terminal's width: the text read back is the text rendered
# The libraries imported while the parser is built that define its options, their help, defaults or choices
HELP_LIBRARIES = ("trl", "transformers", "accelerate", "peft", "torch")


def help_key() -> dict[str, str]:
    """What the help text depends on: those libraries, Python (its argparse lays the text out) and trl-padfree's own
    sources (our fields' help, the shipped configs' names). Read from metadata and files, importing none of them."""
    return {
        "python": platform.python_version(),
        "trl_padfree": sources_digest(),
        **{name: version(name) for name in HELP_LIBRARIES},
    }


def render_help() -> str:
    """The help `make_parser()` prints, `HELP_COLUMNS` wide and without colour (Python 3.14 colours it for a terminal,
    and the cached text is printed to pipes too)."""
    parser = make_parser()
    formatter_class = parser.formatter_class
    parser.formatter_class = lambda prog: formatter_class(prog, width=HELP_COLUMNS)
    if sys.version_info >= (3, 14):
        parser.color = False
    return parser.format_help()


# ---------------------------------------------------------------------------------------------------------------------
# The subcommand: parse here (so bad flags answer at once), train in the processes accelerate launches


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Everything after `dpo` is read by `run` (cli.READS_ITS_OWN_ARGUMENTS): TRL's dataclasses, accelerate's options
    parser.set_defaults(run=run)


def run(options: argparse.Namespace) -> int:
    if {"-h", "--help"} & set(options.arguments):
        print(cached_help("dpo", help_key(), render_help), end="")
        return 0
    argv = resolve_config_arguments(options.arguments)
    # Like `trl dpo`: what none of the dataclasses reads, from the command line or the YAML, is accelerate launch's
    parser = make_parser()
    _, training_args, *_, config_remaining, cli_remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    # The run's first line, said here: accelerate's launcher warns about the defaults it picks before any process runs
    origin = setting_origins(parser, argv, ["padding_free"])["padding_free"]
    print(training_mode(training_args.padding_free, origin), flush=True)
    launch_args = accelerate_launch_arguments(config_remaining + cli_remaining)
    script_args = _without(argv, cli_remaining)
    return launch_module(MODULE, launch_args, script_args, environment={FIRST_LINE_PRINTED: "1"})


def _without(arguments: list[str], removed: list[str]) -> list[str]:
    """`arguments` less `removed`, an ordered subsequence of it."""
    remaining, position = [], 0
    for argument in arguments:
        if position < len(removed) and argument == removed[position]:
            position += 1
        else:
            remaining.append(argument)
    return remaining


def parse_script_arguments(argv: list[str]) -> tuple:
    """The four dataclasses of one training process. In the YAML, keys that are `accelerate launch` options (read by
    `trl-padfree dpo`) are passed over; any other unknown key or flag is an error."""
    parser = make_parser()
    *dataclasses, config_remaining, cli_remaining = parser.parse_args_and_config(
        resolve_config_arguments(argv), return_remaining_strings=True, separate_remaining_strings=True
    )
    unknown = cli_remaining + unknown_launch_options(config_remaining)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return tuple(dataclasses)


if __name__ == "__main__":
    with one_line_errors("trl-padfree dpo"):
        argv = resolve_config_arguments(sys.argv[1:])
        processes = main(*parse_script_arguments(argv), setting_origins(make_parser(), argv, NAMED_ORIGINS))
    if processes > 1:
        # torch's gloo workers may still be releasing the last collectives: see exit_without_finalizing
        exit_without_finalizing()
