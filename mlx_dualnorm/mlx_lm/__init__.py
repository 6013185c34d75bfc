"""mlx-lm's own command line, patched: ``python -m mlx_dualnorm.mlx_lm
SUBCOMMAND ...`` (or the ``mlx-lm-dualnorm`` script) is ``python -m mlx_lm
SUBCOMMAND ...`` with :func:`mlx_dualnorm.integrations.mlx_lm.patch` applied
first.

Every subcommand mlx-lm's CLI dispatches (``generate``, ``server``,
``chat``, ``lora``, ``benchmark``, ...) runs through mlx-lm's own dispatcher,
``mlx_lm.cli.main``, with the same arguments, so its output and exit status
are mlx-lm's. Two flags of this command, taken out of the arguments before
mlx-lm sees them (anywhere before a bare ``--``):

* ``--dualnorm-mode MODE``: passed to ``patch(MODE)``; a name that is no
  mode, or a mode that cannot run here, is one line on stderr (which of
  the two, and the modes) and exit status 2, before mlx-lm runs.
* ``--quiet-dualnorm``: no engagement line at exit.

Unless quiet, one line on stderr at exit (normal exit, ``SystemExit``,
``KeyboardInterrupt``, SIGTERM) says what the patch engaged, from
:func:`mlx_dualnorm.integrations.mlx_lm.report`. A SIGTERM still ends the
process by SIGTERM, as it ends mlx-lm's. Ctrl-C (SIGINT) is mlx-lm's own
to handle: its ``server`` then ends with status 0 or, in a race while the
interpreter shuts down, by SIGABRT, the same two whether patched or not
(docs/mlx-lm.md).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import typing
from typing import NamedTuple, Optional, Sequence

from mlx_dualnorm import Mode

__all__ = [
    "EXIT_USAGE", "MODE_FLAG", "PROGRAM", "QUIET_FLAG", "UsageError", "main", "split_arguments",
]

PROGRAM = "mlx_dualnorm.mlx_lm"
MODE_FLAG = "--dualnorm-mode"
QUIET_FLAG = "--quiet-dualnorm"
EXIT_USAGE = 2


class UsageError(ValueError):
    """This command's own flags are wrong; the message is one line."""


class Arguments(NamedTuple):
    mode: Optional[str]  # None: patch()'s default
    quiet: bool
    mlx_lm_arguments: list[str]  # what mlx-lm's CLI gets, in order


def split_arguments(arguments: Sequence[str]) -> Arguments:
    """Takes this command's flags out of ``arguments``; the rest, in order,
    is mlx-lm's. A bare ``--`` and everything after it are mlx-lm's."""
    mode: Optional[str] = None
    quiet = False
    rest: list[str] = []
    index = 0
    while index < len(arguments):
        argument = arguments[index]
        index += 1
        if argument == "--":
            rest.extend(arguments[index - 1 :])
            break
        if argument == QUIET_FLAG:
            quiet = True
        elif argument == MODE_FLAG or argument.startswith(MODE_FLAG + "="):
            if argument == MODE_FLAG:
                if index == len(arguments):
                    raise UsageError(f"{MODE_FLAG} needs a mode")
                mode = arguments[index]
                index += 1
            else:
                mode = argument[len(MODE_FLAG) + 1 :]
            if not mode:
                raise UsageError(f"{MODE_FLAG} needs a mode")
        else:
            rest.append(argument)
    return Arguments(mode, quiet, rest)


def _say(message: str) -> None:
    """One line on stderr, prefixed with this command's name."""
    line = " ".join(message.split())
    try:
        print(f"[{PROGRAM}] {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed or gone: nothing to tell
        pass


def _apply_patch(mode: Optional[str]) -> None:
    """Imports the integration and patches mlx-lm; raises UsageError (one
    line) for a mode of no such name (naming the modes), or where the
    patch cannot be applied here."""
    modes = typing.get_args(Mode)
    if mode is not None and mode not in modes:
        raise UsageError(f"{MODE_FLAG} {mode}: no such mode; choose from {', '.join(modes)}")
    try:
        from mlx_dualnorm.integrations import mlx_lm as integration
    except ModuleNotFoundError as missing:
        raise UsageError(str(missing)) from missing
    try:
        integration.patch(mode)  # type: ignore[arg-type]  # patch() checks the mode
    except (TypeError, ValueError) as error:
        raise UsageError(f"{MODE_FLAG} {mode}: {error}") from error
    except RuntimeError as error:  # an mlx-lm the integration does not support
        raise UsageError(str(error)) from error


class _ExitLine:
    """Says the engagement line once, whichever way the process ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said = False

    def say(self) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        try:
            from mlx_dualnorm.integrations import mlx_lm as integration

            summary = integration.report().summary()
        except Exception as error:  # the report must never change mlx-lm's exit
            summary = f"no engagement report: {type(error).__name__}: {error}"
        _say(summary)

    def on_sigterm(self, signal_number: int, frame: object) -> None:
        """Says the line, then ends the process by SIGTERM after all, with
        the status mlx-lm's own process gets."""
        self.say()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm(exit_line: _ExitLine) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, exit_line.on_sigterm)


def main(arguments: Optional[Sequence[str]] = None) -> Optional[int]:
    """Runs ``python -m mlx_lm`` on ``arguments`` (default: the process's),
    patched. Returns what mlx-lm's CLI returns; exit status 2 where this
    command's own flags are wrong or the patch cannot be applied."""
    if arguments is None:
        arguments = sys.argv[1:]
    try:
        parsed = split_arguments(arguments)
        _apply_patch(parsed.mode)
    except UsageError as error:
        _say(str(error))
        return EXIT_USAGE

    import mlx_lm.cli

    # mlx-lm's dispatcher reads sys.argv: the program name stays (argparse's
    # usage lines name it), this command's flags go.
    sys.argv = [sys.argv[0] if sys.argv else PROGRAM, *parsed.mlx_lm_arguments]
    if not parsed.quiet:
        # At interpreter exit, so the line comes last: after a traceback of
        # mlx-lm's too, whether it returns, exits or raises.
        exit_line = _ExitLine()
        atexit.register(exit_line.say)
        _install_sigterm(exit_line)
    return mlx_lm.cli.main()
