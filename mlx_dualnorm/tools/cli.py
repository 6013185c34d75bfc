"""``python -m mlx_dualnorm``: the package's main job and its sub-commands.

One skeleton for every command: :func:`tool_parser` gives each sub-command
its usage line (``python -m mlx_dualnorm NAME ...``) and shows every
option's default once; :func:`run_tool` turns argparse's exits, a path or
package that cannot run here, and Ctrl-C into exit statuses, so each tool's
``main(argv)`` returns an int whether it runs from the shell or from a test.

Exit statuses, the same for every command: 0 ok, 1 a mismatch (outputs,
tokens or bits differ), 2 bad usage or something that cannot run here (a
path, a device, an unsupported mlx-lm), 130 interrupted (Ctrl-C; what was
measured so far is printed first).

Global options (``--device``) may come before the sub-command or after it:
``python -m mlx_dualnorm --device cpu parity --quick`` and
``python -m mlx_dualnorm parity --quick --device cpu`` are the same command.

Sub-command modules are imported only when named, so ``--help`` and the
main job never import mlx-lm.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import mlx.core as mx

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_USAGE",
    "InterruptedWithPartialResult",
    "SUBCOMMANDS",
    "StepProgress",
    "SubCommand",
    "Unavailable",
    "add_device_argument",
    "main",
    "non_negative_float",
    "positive_int",
    "positive_int_list",
    "ratio_of_medians",
    "run_tool",
    "select_device",
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


@dataclasses.dataclass(frozen=True)
class SubCommand:
    name: str
    module: str  # imported when the sub-command runs; it defines main(argv) -> int
    summary: str  # one line, for ``python -m mlx_dualnorm --help``


SUBCOMMANDS: tuple[SubCommand, ...] = (
    SubCommand(
        "parity",
        "mlx_dualnorm.tools.parity",
        "check each path, bit for bit, against two mx.fast.rms_norm calls over the "
        "parity matrix, and the norm + RoPE against its composed path",
    ),
    SubCommand(
        "replay",
        "mlx_dualnorm.tools.replay",
        "greedy-decode a small hybrid model with each path; compare tokens and hidden-state bits",
    ),
    SubCommand(
        "bench",
        "mlx_dualnorm.tools.benchmark",
        "time each path against the composed path (host us/call, us/token, prefill, memory)",
    ),
    SubCommand(
        "mlx-lm-check",
        "mlx_dualnorm.tools.mlx_lm_check",
        "generate with mlx-lm unpatched and patched; identical tokens and logit bits, or exit 1",
    ),
    SubCommand(
        "mlx-lm-bench",
        "mlx_dualnorm.tools.mlx_lm_bench",
        "time mlx-lm's normalize_qk against the patch (q/k prework, per-token generation)",
    ),
)

_BY_NAME = {subcommand.name: subcommand for subcommand in SUBCOMMANDS}

MAIN_JOB_DESCRIPTION = (
    "Without a sub-command: a quick bit-parity check (same shape, dtype and bits) of "
    "every path the benchmark times against two mx.fast.rms_norm calls, and of the "
    "norm + RoPE against its composed path; then a quick benchmark on the default "
    "device, with each path's median time as a ratio to the composed path's (lower is "
    "better); last, the parity verdict, with any path skipped and why. Exit status 0 "
    "all bit-identical, 1 a path's output differs, 2 bad usage, 130 interrupted."
)


class _DefaultShownOnceFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, except where the help
    already says its default, for flags (off unless given) and where the
    default is None (the help says what leaving it out does)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (
            "(default" in help_text
            or "default:" in help_text
            or action.default in (None, False, argparse.SUPPRESS)
            or action.nargs == 0  # a flag: store_true, store_const, help
            or not action.option_strings
        ):
            return help_text
        return f"{help_text} (default: %(default)s)"


def tool_parser(subcommand_name: str, description: str) -> argparse.ArgumentParser:
    """The parser of one sub-command: its usage line names the command as
    typed, and every option's help shows its default once."""
    return argparse.ArgumentParser(
        prog=f"{PROGRAM} {subcommand_name}",
        description=description,
        formatter_class=_DefaultShownOnceFormatter,
    )


class InterruptedWithPartialResult(KeyboardInterrupt):
    """Ctrl-C inside a measurement, carrying what it had measured so far
    (``partial``), so the command can print it before exiting 130. Still a
    KeyboardInterrupt for any caller that does not look."""

    def __init__(self, partial: object) -> None:
        super().__init__()
        self.partial = partial


def positive_int(text: str) -> int:
    """argparse ``type`` of a count that must be at least 1: a bad value is
    a usage error (exit 2) naming the option, not a traceback later."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse ``type`` of a finite number >= 0 (an epsilon)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be finite and at least 0, got {text}")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse ``type`` of comma-separated counts, each at least 1; an
    empty string is an empty list (measure none)."""
    return [positive_int(part.strip()) for part in text.split(",") if part.strip()]


DEVICE_CHOICES = ("default", "cpu", "gpu")


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
    from mlx_dualnorm.tools.paths import PathUnavailable

    try:
        arguments = parser.parse_args(list(argv) if argv is not None else None)
        return run(arguments, parser)
    except SystemExit as exit_request:
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    except (Unavailable, PathUnavailable) as cannot_run:
        print(f"{parser.prog}: {cannot_run}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


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


def _main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        usage=f"{PROGRAM} [-h] [--device {{default,cpu,gpu}}] [SUB-COMMAND [OPTIONS]]",
        description=MAIN_JOB_DESCRIPTION,
        epilog=f"'{PROGRAM} SUB-COMMAND --help' shows a sub-command's options; "
        "global options (--device) go before or after the sub-command.",
        formatter_class=_DefaultShownOnceFormatter,
    )
    add_device_argument(parser)
    subcommands = parser.add_subparsers(
        title="sub-commands", metavar="SUB-COMMAND", dest="subcommand"
    )
    for subcommand in SUBCOMMANDS:
        # Listed for --help only: a named sub-command is dispatched before
        # this parser runs, and parses its own options.
        subcommands.add_parser(subcommand.name, help=subcommand.summary, add_help=False)
    return parser


def _run_subcommand(subcommand: SubCommand, argv: Sequence[str]) -> int:
    try:
        module = importlib.import_module(subcommand.module)
    except ModuleNotFoundError as missing:
        if not (missing.name or "").startswith("mlx_lm"):
            raise
        print(
            f"{PROGRAM} {subcommand.name}: needs mlx-lm "
            "(pip install 'mlx_dualnorm[mlx-lm]')",
            file=sys.stderr,
        )
        return 2
    return int(module.main(list(argv)))


def _run_main_job(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The quick bit-parity check of every path the quick benchmark times
    (and of the norm + RoPE), the benchmark's summary, then the parity
    verdict as the last line, with the paths skipped and why."""
    from mlx_dualnorm.tools import benchmark, parity, rope_parity
    from mlx_dualnorm.tools.paths import PATH_REGISTRY, REFERENCE_PATH, unavailable_paths

    select_device(arguments.device, parser)
    mlx_version = getattr(mx, "__version__")  # not in MLX's type stubs
    print(f"mlx_dualnorm on {mx.default_device()} (MLX {mlx_version})\n")
    config = benchmark.BenchmarkConfig.quick()
    benchmarked = [name for name in config.selected_paths() if name != REFERENCE_PATH]
    skipped = unavailable_paths(benchmarked)
    reports = parity.check_paths(
        {name: PATH_REGISTRY[name].factory for name in benchmarked if name not in skipped},
        rope_parity.available_rope_paths(),
        quick=True,
    )
    print()
    report = benchmark.run_benchmark(config, progress=benchmark.progress_to_stderr)
    print(benchmark.summary_table(report))
    print()
    for line in parity.skipped_path_lines(skipped):
        print(line)
    print(parity.parity_verdict(reports))
    return EXIT_OK if all(parity_report.passed for parity_report in reports) else EXIT_MISMATCH


def _split_at_subcommand(
    argv: Sequence[str], parser: argparse.ArgumentParser
) -> tuple[list[str], Optional[SubCommand], list[str]]:
    """(global options, the sub-command or None, the sub-command's own
    arguments). Global options are the main parser's; the value of one
    that takes a value is never read as a sub-command name."""
    options_taking_a_value = {
        option
        for action in parser._actions  # argparse has no public list of its options
        if action.nargs != 0 and action.option_strings
        for option in action.option_strings
    }
    index = 0
    while index < len(argv):
        token = argv[index]
        if token in _BY_NAME:
            return list(argv[:index]), _BY_NAME[token], list(argv[index + 1 :])
        if token == "--":
            break
        index += 2 if token in options_taking_a_value else 1
    return list(argv), None, []


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the sub-command named, with the global options given before it
    passed on ahead of its own (every sub-command takes them, so a global
    option given after the sub-command works too); without one, the main
    job."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _main_parser()
    global_options, subcommand, subcommand_arguments = _split_at_subcommand(argv, parser)
    if subcommand is None:
        return run_tool(parser, _run_main_job, argv)
    if global_options:
        # Bad global options (or --help before the sub-command) are the main
        # parser's to report.
        status = run_tool(parser, lambda arguments, parser: EXIT_OK, global_options)
        if status != EXIT_OK or any(option in ("-h", "--help") for option in global_options):
            return status
    return _run_subcommand(subcommand, [*global_options, *subcommand_arguments])
