"""The `trl-padfree` command: `dpo`, `configs`, `demo`, `bench`, `plan`, `models` and `balance`, each imported only
when it runs (`dpo`, `bench` and `demo` build trainers; `--help` and the other commands need none of that).

The parser and `main` are in subcommands.py; how the command ends (a user error as one line, `TRL_PADFREE_DEBUG=1`
for the traceback; a distributed process's exit) in exits.py.
"""

from .exits import USER_ERRORS, exit_without_finalizing, one_line_errors, one_line_usage_errors
from .subcommands import READS_ITS_OWN_ARGUMENTS, SUBCOMMANDS, build_parser, main

__all__ = [
    "READS_ITS_OWN_ARGUMENTS",
    "SUBCOMMANDS",
    "USER_ERRORS",
    "build_parser",
    "exit_without_finalizing",
    "main",
    "one_line_errors",
    "one_line_usage_errors",
]
