"""``python -m mlx_dualnorm.mlx_lm SUBCOMMAND ...`` (``mlx-lm-dualnorm``) is
``python -m mlx_lm SUBCOMMAND ...`` patched first; output and exit status are
mlx-lm's. Own flags (before a bare ``--``): ``--dualnorm-mode MODE`` (a bad mode:
one line, exit 2) and ``--quiet-dualnorm`` (no engagement line at exit). A SIGTERM
still ends the process by SIGTERM; Ctrl-C is mlx-lm's to handle (docs/mlx-lm.md)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import typing
from typing import NamedTuple, Optional, Sequence

from mlx_dualnorm import Mode

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
    """This command's flags; the rest, in order, and all after a bare ``--`` are mlx-lm's."""
    mode: Optional[str] = None
    quiet = False
    rest: list[str] = []
    items = iter(arguments)
    for argument in items:
        if argument == "--":
            rest += [argument, *items]
        elif argument == QUIET_FLAG:
            quiet = True
        elif argument == MODE_FLAG or argument.startswith(MODE_FLAG + "="):
            mode = next(items, "") if argument == MODE_FLAG else argument[len(MODE_FLAG) + 1 :]
            if not mode:
                raise UsageError(f"{MODE_FLAG} needs a mode")
        else:
            rest.append(argument)
    return Arguments(mode, quiet, rest)


def _say(message: str) -> None:
    """One line on stderr, prefixed with this command's name."""
    with contextlib.suppress(OSError, ValueError):  # stderr closed or gone: nothing to tell
        print(f"[{PROGRAM}] {' '.join(message.split())}", file=sys.stderr, flush=True)


def _apply_patch(mode: Optional[str]) -> None:
    """Patches mlx-lm; UsageError for a mode of no such name or a patch that cannot apply."""
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


_EXIT_LINE_SAID = threading.Lock()  # taken by the first to say it, never released


def _say_engagement() -> None:
    """Says the engagement line once, whichever way the process ends."""
    if not _EXIT_LINE_SAID.acquire(blocking=False):
        return
    try:
        from mlx_dualnorm.integrations import mlx_lm as integration

        summary = integration.report().summary()
    except Exception as error:  # the report must never change mlx-lm's exit
        summary = f"no engagement report: {type(error).__name__}: {error}"
    _say(summary)


def _on_sigterm(signal_number: int, frame: object) -> None:
    """Says the line, then ends by SIGTERM after all, as mlx-lm's own process would."""
    _say_engagement()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def main(arguments: Optional[Sequence[str]] = None) -> Optional[int]:
    """``python -m mlx_lm`` on ``arguments`` (default: the process's), patched;
    2 where this command's own flags are wrong or the patch cannot be applied."""
    try:
        parsed = split_arguments(sys.argv[1:] if arguments is None else arguments)
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
        atexit.register(_say_engagement)
        # Signal handlers belong to the main thread; one already set is left alone.
        in_main_thread = threading.current_thread() is threading.main_thread()
        if in_main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    return mlx_lm.cli.main()
