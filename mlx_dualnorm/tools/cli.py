"""``python -m mlx_dualnorm``: the package's main job and its sub-commands.

One skeleton for every command: :func:`tool_parser` gives each sub-command
its usage line (``python -m mlx_dualnorm NAME ...``) and shows every
option's default; :func:`run_tool` turns argparse's exits into exit
statuses, so each tool's ``main(argv)`` returns an int (0 after ``--help``,
2 on bad usage) whether it runs from the shell or from a test.

Sub-command modules are imported only when named, so ``--help`` and the
main job never import mlx-lm.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from typing import Callable, Optional, Sequence

import mlx.core as mx

__all__ = [
    "SUBCOMMANDS",
    "SubCommand",
    "add_device_argument",
    "main",
    "run_tool",
    "select_device",
    "tool_parser",
]

PROGRAM = "python -m mlx_dualnorm"


@dataclasses.dataclass(frozen=True)
class SubCommand:
    name: str
    module: str  # imported when the sub-command runs; it defines main(argv) -> int
    summary: str  # one line, for ``python -m mlx_dualnorm --help``


SUBCOMMANDS: tuple[SubCommand, ...] = (
    SubCommand(
        "parity",
        "mlx_dualnorm.tools.parity",
        "check each path against two mx.fast.rms_norm calls over the parity matrix",
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
    "Without a sub-command: a quick parity check of every path against two "
    "mx.fast.rms_norm calls (same shape, dtype and bits), then a "
    "quick benchmark on the default device, with each path's time as a ratio to the "
    "composed path's (lower is better). Exit status 1 if any path's output differs."
)


def tool_parser(subcommand_name: str, description: str) -> argparse.ArgumentParser:
    """The parser of one sub-command: its usage line names the command as
    typed, and every option's help shows its default."""
    return argparse.ArgumentParser(
        prog=f"{PROGRAM} {subcommand_name}",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("default", "cpu", "gpu"),
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
    the exit status."""
    try:
        arguments = parser.parse_args(list(argv) if argv is not None else None)
        return run(arguments, parser)
    except SystemExit as exit_request:
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else 2)


def _main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        usage=f"{PROGRAM} [-h] [--device {{default,cpu,gpu}}] [SUB-COMMAND [OPTIONS]]",
        description=MAIN_JOB_DESCRIPTION,
        epilog=f"'{PROGRAM} SUB-COMMAND --help' shows a sub-command's options.",
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
    """The quick parity check, then the quick benchmark's summary."""
    from mlx_dualnorm.tools import benchmark, parity

    select_device(arguments.device, parser)
    mlx_version = getattr(mx, "__version__")  # not in MLX's type stubs
    print(f"mlx_dualnorm on {mx.default_device()} (MLX {mlx_version})\n")
    parity_status = parity.main(["--quick", "--bitwise"])
    print()
    report = benchmark.run_benchmark(
        benchmark.BenchmarkConfig.quick(), progress=benchmark.progress_to_stderr
    )
    print(benchmark.summary_table(report))
    return parity_status


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _BY_NAME:
        return _run_subcommand(_BY_NAME[argv[0]], argv[1:])
    return run_tool(_main_parser(), _run_main_job, argv)
