"""How the `trl-padfree` command ends: a user error as one line on stderr (`TRL_PADFREE_DEBUG=1` shows the
traceback), a bad flag without the usage block, and a finished distributed process without interpreter finalization.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import NoReturn

# What a user can fix from the message alone (a bad option or config key, a missing file or model); anything else is
# a bug and keeps its traceback
USER_ERRORS = (ValueError, OSError, NotImplementedError, ImportError)  # ImportError: a missing optional package


@contextlib.contextmanager
def one_line_errors(program: str):
    """Turn a user error raised inside into one line on stderr and exit status 2."""
    try:
        yield
    except USER_ERRORS as error:
        if os.environ.get("TRL_PADFREE_DEBUG"):
            raise
        message = " ".join(str(error).split())  # some library messages span lines
        print(f"{program}: error: {message}", file=sys.stderr)
        sys.exit(2)


def exit_without_finalizing(status: int = 0) -> NoReturn:
    """End a finished distributed process at once, logs and streams flushed, without Python's interpreter
    finalization. Call it last, after `trainer.end()`.

    torch.distributed's gloo backend (every CPU launch) runs worker threads that release each finished collective's
    tensors themselves, and `trainer.end()` (destroy_process_group) does not stop them. On a loaded machine a worker can
    reach that release only after the main thread has begun finalizing the interpreter, typically on a rank with
    nothing left to write (ZeRO-3's last parameter gathers, at save time). The release needs the GIL; Python 3.11
    ends a thread that asks for it during finalization (pthread_exit), the unwinding crosses torch's noexcept C++
    frame, and the process aborts ("terminate called without an active exception", SIGABRT) after a run that
    trained and saved. With no finalization there is nothing for a late worker to run into.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class OneLineErrorParser(argparse.ArgumentParser):
    """A parser that reports a bad flag in one line, without the usage block (the `trl-padfree` parser)."""

    def error(self, message):
        _exit_with_usage_error(self, message)


def one_line_usage_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` (e.g. a `TrlParser`) report a bad flag in one line, without the usage block."""
    parser.error = lambda message: _exit_with_usage_error(parser, message)
    return parser


def _exit_with_usage_error(parser: argparse.ArgumentParser, message: str):
    parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")
