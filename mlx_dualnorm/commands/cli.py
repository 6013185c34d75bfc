"""``python -m mlx_dualnorm``: the main job, and dispatch to the sub-commands.
Global options (``--device``) may come before the sub-command or after it. A
sub-command's module is imported only when named: ``--help`` and the main job
never import mlx-lm."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm.commands import bench as benchmark, parity
from mlx_dualnorm.commands.parity import matrices
from mlx_dualnorm.commands.shared.command import (
    EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, PROGRAM, DefaultShownOnceFormatter, ToolParser,
    add_device_argument, error_line, run_tool, select_device,
)
from mlx_dualnorm.commands.shared.paths import PATH_REGISTRY, REFERENCE_PATH, unavailable_paths


class SubCommand(NamedTuple):
    name: str
    summary: str  # one line, for ``python -m mlx_dualnorm --help``

    @property
    def module(self) -> str:
        """Imported when the sub-command runs; it defines main(argv) -> int."""
        return f"mlx_dualnorm.commands.{self.name.replace('-', '_')}"


SUBCOMMANDS: tuple[SubCommand, ...] = (
    SubCommand("parity", "check each path, bit for bit, against two mx.fast.rms_norm calls over "
               "the parity matrix, and the norm + RoPE against its composed path"),
    SubCommand("replay", "greedy-decode a small hybrid model with each path; compare tokens and "
               "hidden-state bits"),
    SubCommand("bench", "time each path against the composed path (host us/call, us/token, "
               "prefill, memory)"),
    SubCommand("mlx-lm-check", "generate with mlx-lm unpatched and patched; identical tokens and "
               "logit bits, or exit 1"),
    SubCommand("mlx-lm-bench", "time mlx-lm decode unpatched against patched at released model "
               "sizes, greedy tokens compared every round"),
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


def _main_parser() -> argparse.ArgumentParser:
    parser = ToolParser(
        prog=PROGRAM, operation="mlx_dualnorm", description=MAIN_JOB_DESCRIPTION,
        usage=f"{PROGRAM} [-h] [--device {{default,cpu,gpu}}] [SUB-COMMAND [OPTIONS]]",
        epilog=f"'{PROGRAM} SUB-COMMAND --help' shows a sub-command's options; "
        "global options (--device) go before or after the sub-command.",
        formatter_class=DefaultShownOnceFormatter,
    )
    add_device_argument(parser)
    subcommands = parser.add_subparsers(title="sub-commands", metavar="SUB-COMMAND",
                                        dest="subcommand")
    for subcommand in SUBCOMMANDS:
        # For --help only: a named sub-command is dispatched before this parser runs.
        subcommands.add_parser(subcommand.name, help=subcommand.summary, add_help=False)
    return parser


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The parser sub-command ``name`` runs (its module's ``build_parser()``)."""
    return importlib.import_module(_BY_NAME[name].module).build_parser()


def _run_main_job(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The main job, as ``MAIN_JOB_DESCRIPTION`` tells it."""
    select_device(arguments.device, parser)
    mlx_version = getattr(mx, "__version__")  # not in MLX's type stubs
    print(f"mlx_dualnorm on {mx.default_device()} (MLX {mlx_version})\n")
    config = benchmark.BenchmarkConfig.quick()
    benchmarked = [name for name in config.selected_paths() if name != REFERENCE_PATH]
    skipped = unavailable_paths(benchmarked)
    reports = parity.check_paths(
        {name: PATH_REGISTRY[name].factory for name in benchmarked if name not in skipped},
        matrices.available_rope_paths(), quick=True,
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
    """(global options, the sub-command or None, its own arguments); the
    value of a global option is never read as a sub-command name."""
    # argparse has no public list of its options.
    takes_a_value = {option for action in parser._actions if action.nargs != 0
                     for option in action.option_strings}
    index = 0
    while index < len(argv):
        token = argv[index]
        if token in _BY_NAME:
            return list(argv[:index]), _BY_NAME[token], list(argv[index + 1 :])
        if token == "--":
            break
        index += 2 if token in takes_a_value else 1
    return list(argv), None, []


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The sub-command named (the global options before it passed on), or the main job."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _main_parser()
    global_options, subcommand, subcommand_arguments = _split_at_subcommand(argv, parser)
    if subcommand is None:
        return run_tool(parser, _run_main_job, argv)
    if global_options:
        # Bad global options (or --help before the sub-command) are the main parser's to report.
        status = run_tool(parser, lambda arguments, parser: EXIT_OK, global_options)
        if status != EXIT_OK or any(option in ("-h", "--help") for option in global_options):
            return status
    try:
        module = importlib.import_module(subcommand.module)
    except ModuleNotFoundError as missing:
        if not (missing.name or "").startswith("mlx_lm"):
            raise
        message = error_line(subcommand.name, "needs mlx-lm (pip install 'mlx-lm==0.32.2')")
        print(message, file=sys.stderr)
        return EXIT_USAGE
    return int(module.main([*global_options, *subcommand_arguments]))
