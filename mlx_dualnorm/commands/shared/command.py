"""What every ``python -m mlx_dualnorm`` command shares: its parser (usage
errors as one line, ``[NAME] message``), bounded argument types checked before
any work, exit statuses, progress lines, table summaries and JSON files."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import (
    Any, Callable, Collection, Iterator, NoReturn, Optional, Sequence, get_args,
)

import mlx.core as mx

from mlx_dualnorm import Mode
from mlx_dualnorm.commands.shared.paths import PathUnavailable

PROGRAM = "python -m mlx_dualnorm"
EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2  # bad usage, or what was asked cannot run here
EXIT_INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (SIGINT)

DEVICE_CHOICES = ("default", "cpu", "gpu")
# A mode name not among these is a usage error naming the choices; a mode
# among them that this build or device lacks is refused by patch().
MODE_CHOICES: tuple[str, ...] = get_args(Mode)


@dataclasses.dataclass(frozen=True)
class _Range:
    """The argparse ``type`` of every number option: its range is checked where
    argparse reads it, shown in its help and bounds what the option can cost."""

    minimum: float
    maximum: float
    _format = ""  # how the bounds are written

    @property
    def range_text(self) -> str:
        return f"{self.minimum:{self._format}} to {self.maximum:{self._format}}"


class Count(_Range):
    """An integer from ``minimum`` to ``maximum``."""

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if self.minimum <= value <= self.maximum:
            return value
        if self.minimum == 1:  # a count: "at least 1" / "at most N" reads best
            bound = "at least 1" if value < 1 else f"at most {self.maximum}"
        else:
            bound = f"from {self.range_text}"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")


class Number(_Range):
    """A finite number from ``minimum`` to ``maximum``."""

    _format = "g"

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and self.minimum <= value <= self.maximum):
            raise argparse.ArgumentTypeError(f"must be finite, from {self.range_text}, got {text}")
        return value


# Numpy's seed range: parity's case keys use the seed's low 32 bits, so a
# wider seed would repeat another's values.
SEED_MAX = 2**32 - 1
seed = Count(0, SEED_MAX)  # argparse ``type`` of every command's ``--seed``


def name_list(flag: str, text: str, known: Collection[str]) -> list[str]:
    """The comma-separated names of ``flag`` (``''``: none), each one of ``known`` and each
    once, so a list cannot make a run longer than all of ``known``; ValueError naming an
    empty or unknown name."""
    parts = [name.strip() for name in text.split(",")]
    if text.strip() and not all(parts):
        raise ValueError(f"{flag}: an empty name in {text!r}")
    names = list(dict.fromkeys(name for name in parts if name))
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"{flag}: unknown {unknown}; choose from {', '.join(known)}")
    return names


def _path(text: str) -> pathlib.Path:
    """An output path, ``~`` expanded; not empty (the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a path")
    try:
        return pathlib.Path(text).expanduser()
    except RuntimeError as no_home:  # "~nouser/x"
        raise argparse.ArgumentTypeError(f"cannot write {text}: {no_home}") from None


def output_folder(text: str) -> pathlib.Path:
    """A folder a command writes into, tried for real before any work (permission
    bits say nothing for root, a read-only mount or /proc), leaving nothing."""
    path = _path(text)
    created: list[pathlib.Path] = []
    try:
        if path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
        folder = path.absolute()
        while not folder.exists():
            created.append(folder)
            folder = folder.parent
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"cannot create {text}: {folder} is not a folder")
        for missing in reversed(created):
            missing.mkdir()
        with tempfile.NamedTemporaryFile(dir=path, prefix=".mlx_dualnorm-write-check-"):
            pass
    except OSError as failed:  # no permission, a name too long, a loop of links, ...
        raise _cannot_write(text, failed) from None
    finally:
        for made in created:  # deepest first
            with contextlib.suppress(OSError):
                made.rmdir()
    return path


def output_file(text: str) -> pathlib.Path:
    """A file a command writes, in an existing folder, tried for real before
    any work: opened for appending (nothing written), or created and removed."""
    path = _path(text)
    try:
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; give the path of a file")
        folder = path.absolute().parent
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"no folder {folder} to write {path.name} into")
        existed = path.exists()
        with open(path, "a" if existed else "x"):
            pass
        if not existed:
            path.unlink()
    except OSError as failed:
        raise _cannot_write(text, failed) from None
    return path


def _cannot_write(text: str, failed: OSError) -> argparse.ArgumentTypeError:
    """The refusal of an output path the system would not let a command write."""
    return argparse.ArgumentTypeError(f"cannot write {text}: {failed.strerror or failed}")


class Unavailable(Exception):
    """What a tool was asked to run cannot run here (a mode this build or device
    lacks, an unsupported mlx-lm): one line and exit 2, no traceback."""


class InterruptedWithPartialResult(KeyboardInterrupt):
    """Ctrl-C inside a measurement, carrying what was measured (``partial``) to print."""

    def __init__(self, partial: object) -> None:
        super().__init__()
        self.partial = partial


class DefaultShownOnceFormatter(argparse.HelpFormatter):
    """Appends an option's range and default to its help, "(1 to 512;
    default: 48)"; no default for flags, None or where the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        notes = []
        bounds = getattr(action.type, "range_text", None)
        if bounds is not None and help_text is not argparse.SUPPRESS:
            notes.append(bounds)
        said = "(default" in help_text or "default:" in help_text
        if (action.option_strings and action.nargs != 0 and not said
                and action.default not in (None, False, argparse.SUPPRESS)):
            notes.append("default: %(default)s")
        return f"{help_text} ({'; '.join(notes)})" if notes else help_text


def error_line(operation: str, message: str) -> str:
    """``[operation] message``, a message of several lines joined into one."""
    return f"[{operation}] {' '.join(message.split())}"


def cause(error: BaseException) -> str:
    """``error`` as the end of a one-line message: its type and its text."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class ToolParser(argparse.ArgumentParser):
    """Usage errors are one line, ``[operation] message`` and where --help is, exit 2."""

    def __init__(self, *arguments: Any, operation: Optional[str] = None, **options: Any) -> None:
        super().__init__(*arguments, **options)
        self.operation = operation or self.prog

    def error(self, message: str) -> NoReturn:
        line = error_line(self.operation, f"{message} ({self.prog} --help lists the options)")
        self.exit(EXIT_USAGE, line + "\n")


def tool_parser(subcommand_name: str, description: str) -> ToolParser:
    """The parser of one sub-command, its usage line naming it as typed."""
    return ToolParser(prog=f"{PROGRAM} {subcommand_name}", description=description,
                      formatter_class=DefaultShownOnceFormatter, operation=subcommand_name)


def add_mode_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode", choices=MODE_CHOICES, default=None,
        help="mode for mlx_dualnorm.integrations.mlx_lm.patch() (default: patch()'s own)",
    )


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=DEVICE_CHOICES, default="default",
        help="MLX default device to run on ('default' keeps MLX's choice)",
    )


def select_device(device_name: str, parser: argparse.ArgumentParser) -> None:
    """``--device``; "gpu" without a GPU backend is a usage error (exit 2)."""
    if device_name == "cpu":
        mx.set_default_device(mx.cpu)
    elif device_name == "gpu":
        if not mx.is_available(mx.gpu):
            parser.error("--device gpu: this MLX has no GPU backend")
        mx.set_default_device(mx.gpu)


def run_tool(parser: argparse.ArgumentParser,
             run: Callable[[argparse.Namespace, argparse.ArgumentParser], int],
             argv: Optional[Sequence[str]]) -> int:
    """Runs the tool on ``argv``: its exit status, argparse's (0 after --help, 2 on bad
    usage), 2 for :class:`Unavailable` and ``PathUnavailable``, 130 for Ctrl-C."""
    operation = getattr(parser, "operation", parser.prog)
    try:
        return run(parser.parse_args(list(argv) if argv is not None else None), parser)
    except SystemExit as exit_request:
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    except (Unavailable, PathUnavailable) as cannot_run:
        print(error_line(operation, str(cannot_run)), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(error_line(operation, "interrupted"), file=sys.stderr)
        return EXIT_INTERRUPTED


def progress_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_json(path: os.PathLike[str] | str, data: object) -> pathlib.Path:
    """``data`` as the commands' JSON files hold it: indented, a newline last."""
    destination = pathlib.Path(path)
    destination.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return destination


@contextlib.contextmanager
def writing(target: object) -> Iterator[None]:
    """An OSError writing ``target`` after the run (a full disk, a folder removed
    meanwhile) is :class:`Unavailable`: the tables were printed first."""
    try:
        yield
    except OSError as failed:
        raise Unavailable(f"could not write {target}: {failed.strerror or failed}") from failed


def spread(values: Sequence[float]) -> dict[str, float]:
    """min, median and max of ``values``: how a table sums up the repeats."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def ratio_of_medians(values: Sequence[float], reference_values: Sequence[float]) -> Optional[float]:
    """The ratio printed beside two medians, never contradicting them (a median of
    ratios can): None when either is empty or the reference median is not > 0."""
    if not values or not reference_values or not statistics.median(reference_values) > 0:
        return None
    return statistics.median(values) / statistics.median(reference_values)


class StepProgress:
    """One line per step (to ``emit``, else stderr): the step of how many, the
    time so far and left; at most one per ``min_interval_s`` but the last. The
    time left is at the pace since the previous line, so a slow first step
    (kernels compiled, a model loaded) does not inflate every estimate."""

    def __init__(self, stage: str, steps: int, *, min_interval_s: float = 0.0,
                 emit: Optional[Callable[[str], None]] = None) -> None:
        self.stage = stage
        self.emit = emit or progress_to_stderr
        self.steps = max(steps, 1)
        self.done = 0
        self.started = time.perf_counter()
        self.min_interval_s = min_interval_s
        self._last_printed = self.started
        self._done_at_last_print = 0

    def step(self, detail: str = "") -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self._last_printed < self.min_interval_s and self.done < self.steps:
            return
        pace = (now - self._last_printed) / (self.done - self._done_at_last_print)
        self._last_printed, self._done_at_last_print = now, self.done
        elapsed = now - self.started
        left = pace * max(self.steps - self.done, 0)
        suffix = f" {detail}" if detail else ""
        self.emit(f"{self.stage}: {self.done}/{self.steps}{suffix}, "
                  f"{elapsed:.0f} s so far, ~{left:.0f} s left")
