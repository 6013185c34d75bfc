"""What every ``python -m mlx_dualnorm`` command shares: its parser, its
argument types, its exit statuses, its progress lines.

:func:`tool_parser` gives each sub-command its usage line
(``python -m mlx_dualnorm NAME ...``) and shows every option's default
once, and reports a bad argument in one line, ``[NAME] message``;
:func:`run_tool` turns argparse's exits, a path or package that cannot
run here, and Ctrl-C into exit statuses, so each tool's ``main(argv)``
returns an int whether it runs from the shell or from a test. The
argument types here check each value where argparse reads it, the same
way for every command, before any work: every number is a :class:`Count`
or :class:`Number` (or a :class:`CountList` of counts) with a range that
its help shows, and output paths are tried for real.

Exit statuses, the same for every command: 0 ok, 1 a mismatch (outputs,
tokens or bits differ), 2 bad usage or something that cannot run here (a
path, a device, an unsupported mlx-lm), 130 interrupted (Ctrl-C; what was
measured so far is printed first).

The argument types live in :mod:`~mlx_dualnorm.commands.shared.arguments`
and are re-exported here. The command line itself
(:mod:`mlx_dualnorm.commands.cli`) and every command import this module;
it imports none of them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import typing
from typing import Any, Callable, NoReturn, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm import Mode
from mlx_dualnorm.commands.shared.arguments import (
    SEED_MAX, Count, CountList, Number, output_file, output_folder, seed,
)
from mlx_dualnorm.commands.shared.paths import PathUnavailable

__all__ = [
    "Count", "CountList", "DefaultShownOnceFormatter", "EXIT_INTERRUPTED", "EXIT_MISMATCH",
    "EXIT_OK", "EXIT_USAGE", "InterruptedWithPartialResult", "MODE_CHOICES", "Number",
    "PROGRAM", "SEED_MAX", "StepProgress", "ToolParser", "Unavailable",
    "add_device_argument", "add_mode_argument", "cause", "error_line", "output_file",
    "output_folder", "ratio_of_medians", "run_tool", "seed", "select_device", "spread",
    "tool_parser",
]

PROGRAM = "python -m mlx_dualnorm"
EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2  # bad usage, or what was asked cannot run here
EXIT_INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (SIGINT)


class Unavailable(Exception):
    """What a tool was asked to run cannot run here (a mode this build or
    device lacks, an unsupported mlx-lm): :func:`run_tool` prints the
    message on one line and exits 2, with no traceback."""


class DefaultShownOnceFormatter(argparse.HelpFormatter):
    """Appends an option's range (from its bounded ``type``) and its
    default to its help, "(1 to 512; default: 48)"; the default is left
    out where the help already says it, for flags (off unless given) and
    where it is None (the help says what leaving it out does)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        notes = []
        bounds = getattr(action.type, "range_text", None)
        if bounds is not None and help_text is not argparse.SUPPRESS:
            notes.append(bounds)
        if not (
            "(default" in help_text
            or "default:" in help_text
            or action.default in (None, False, argparse.SUPPRESS)
            or action.nargs == 0  # a flag: store_true, store_const, help
            or not action.option_strings
        ):
            notes.append("default: %(default)s")
        return f"{help_text} ({'; '.join(notes)})" if notes else help_text


def error_line(operation: str, message: str) -> str:
    """The one line a command prints on stderr when it refuses to run:
    ``[operation] message``, a message of several lines (a library's
    exception, say) joined into one."""
    return f"[{operation}] {' '.join(message.split())}"


def cause(error: BaseException) -> str:
    """``error`` as the end of a one-line message: its type and its text
    (the type alone where it has none)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class ToolParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr,
    ``[operation] message`` and where ``--help`` is (argparse's own prints
    the whole usage first), exit status 2. ``operation`` is the
    sub-command's name (default: ``prog``)."""

    def __init__(self, *arguments: Any, operation: Optional[str] = None, **options: Any) -> None:
        super().__init__(*arguments, **options)
        self.operation = operation or self.prog

    def error(self, message: str) -> NoReturn:
        line = error_line(self.operation, f"{message} ({self.prog} --help lists the options)")
        self.exit(EXIT_USAGE, line + "\n")


def tool_parser(subcommand_name: str, description: str) -> ToolParser:
    """The parser of one sub-command: its usage line names the command as
    typed, every option's help shows its default once, and a bad argument
    is one line on stderr, ``[subcommand] message``."""
    return ToolParser(
        prog=f"{PROGRAM} {subcommand_name}",
        description=description,
        formatter_class=DefaultShownOnceFormatter,
        operation=subcommand_name,
    )


class InterruptedWithPartialResult(KeyboardInterrupt):
    """Ctrl-C inside a measurement, carrying what it had measured so far
    (``partial``), so the command can print it before exiting 130. Still a
    KeyboardInterrupt for any caller that does not look."""

    def __init__(self, partial: object) -> None:
        super().__init__()
        self.partial = partial


DEVICE_CHOICES = ("default", "cpu", "gpu")
# The package's modes, by name: a name not among them is a usage error
# naming the choices; a mode among them that this build or device lacks
# is refused by patch() as one that cannot run here.
MODE_CHOICES: tuple[str, ...] = typing.get_args(Mode)


def add_mode_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode", choices=MODE_CHOICES, default=None,
        help="mode for mlx_dualnorm.integrations.mlx_lm.patch() (default: patch()'s own)",
    )


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="default",
        help="MLX default device to run on ('default' keeps MLX's choice)",
    )


def select_device(device_name: str, parser: argparse.ArgumentParser) -> None:
    """``--device``: "gpu" without a GPU backend is a usage error (exit 2),
    not a traceback."""
    if device_name == "cpu":
        mx.set_default_device(mx.cpu)
    elif device_name == "gpu":
        if not mx.is_available(mx.gpu):
            parser.error("--device gpu: this MLX has no GPU backend")
        mx.set_default_device(mx.gpu)


def run_tool(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int],
    argv: Optional[Sequence[str]],
) -> int:
    """Parses ``argv`` and runs the tool. argparse exits (0 after --help, 2
    on bad usage, also from ``parser.error`` inside ``run``) come back as
    the exit status; so do :class:`Unavailable` and a path's
    ``PathUnavailable`` (2, one line on stderr) and Ctrl-C (130: a tool
    that has partial results prints them before the interrupt reaches
    here)."""
    try:
        arguments = parser.parse_args(list(argv) if argv is not None else None)
        return run(arguments, parser)
    except SystemExit as exit_request:
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    except (Unavailable, PathUnavailable) as cannot_run:
        print(error_line(_operation(parser), str(cannot_run)), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(error_line(_operation(parser), "interrupted"), file=sys.stderr)
        return EXIT_INTERRUPTED


def _operation(parser: argparse.ArgumentParser) -> str:
    return getattr(parser, "operation", parser.prog)


def spread(values: Sequence[float]) -> dict[str, float]:
    """min, median and max of ``values``: how a table sums up the repeats."""
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
    }


def ratio_of_medians(values: Sequence[float], reference_values: Sequence[float]) -> Optional[float]:
    """median(values) / median(reference_values): the ratio a table prints
    beside those two medians, so the three never contradict each other (a
    median of per-round ratios can fall on the other side of 1). The
    per-round ratios' min..max is the spread to print with it. None when
    either is empty or the reference median is not positive."""
    if not values or not reference_values:
        return None
    reference_median = statistics.median(reference_values)
    if not reference_median > 0:
        return None
    return statistics.median(values) / reference_median


class StepProgress:
    """One line per step on stderr: which step of how many, the time so
    far and an estimate of the time left (from the mean step so far), so
    a long run shows it is moving and how long it will take.

    ``steps`` is the total expected; ``step(detail)`` reports one more
    done, on stderr or to ``emit``. With ``min_interval_s``, a step is printed only that long after
    the last printed one (and the last step always), for runs of many
    short steps."""

    def __init__(
        self,
        stage: str,
        steps: int,
        *,
        min_interval_s: float = 0.0,
        emit: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.stage = stage
        self.emit = emit
        self.steps = max(steps, 1)
        self.done = 0
        self.started = time.perf_counter()
        self.min_interval_s = min_interval_s
        self._last_printed = self.started

    def step(self, detail: str = "") -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self._last_printed < self.min_interval_s and self.done < self.steps:
            return
        self._last_printed = now
        elapsed = now - self.started
        left = elapsed / self.done * max(self.steps - self.done, 0)
        suffix = f" {detail}" if detail else ""
        line = (
            f"{self.stage}: {self.done}/{self.steps}{suffix}, "
            f"{elapsed:.0f} s so far, ~{left:.0f} s left"
        )
        if self.emit is not None:
            self.emit(line)
        else:
            print(line, file=sys.stderr, flush=True)
