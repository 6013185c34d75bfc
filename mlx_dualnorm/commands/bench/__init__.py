"""Benchmarks of the compiled dual head norm against the paths it replaces.

One run measures every registered path on the default MLX device:

* host us per dual call: graph build only, no evaluation, at the two decode
  shapes (the median of many calls; the outputs of each timed batch are
  kept alive and released outside the timed region, and the release is
  reported on its own);
* us per decode token: ``layers`` dual calls chained lazily (each layer's
  normalized queries and keys are the next layer's inputs) and one
  ``mx.eval`` per token, at the gated-delta decode shape (q and k
  ``(1, 1, 16, 128)`` bf16, no weights) and the full-attention decode shape
  (q ``(1, 1, 16, 256)``, k ``(1, 1, 2, 256)`` bf16, weighted);
* one dual call at the prefill shape ``(1, 512, 16, 128)``: time (build and
  eval) and the peak memory above the resident inputs.

Every number is taken once per repeat for every path, as the median of its
samples; inside a repeat the paths take their samples in turn (one batch
or call each, decode tokens ``decode_tokens_per_turn`` at a time, as decode
runs one path token after token; the order rotating and reversing), so load
that comes and goes on the machine falls on all of them alike. Values are
reported as min / median / max over the repeats. The ratio to the baseline
path (``composed``) a table prints is the ratio of the two medians it
prints beside it; the ratios taken per repeat give its spread (their
min-max), so a noisy machine shows as a wide range, never as a ratio that
contradicts its medians.

A ratio is always ``value(path) / value(composed)`` (time, or peak memory):
lower is better, below 1 the path beats the composed path.

The paths are those of :mod:`mlx_dualnorm.commands.shared.paths`, by the names every
tool uses; adding one is one ``register_path`` call. A factory, or a call,
that raises :class:`PathUnavailable` marks the path (or that path at that
shape) as skipped instead of failing the run.

``main(argv)`` is the command line (``python -m mlx_dualnorm bench``);
``run_benchmark(config)`` the programmatic API; ``summary_table`` the short
table the package's main job prints. The parts live apart, and this module
re-exports their API: what is measured and what a run holds
(:mod:`~mlx_dualnorm.commands.bench.results`), the measurements
(:mod:`~mlx_dualnorm.commands.bench.measurements`), the JSON, chart and
tables (:mod:`~mlx_dualnorm.commands.bench.report`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any, Optional, Sequence

from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.bench.measurements import interleaved_samples, run_benchmark
from mlx_dualnorm.commands.bench.report import (
    CHART_FILE_NAME,
    JSON_FILE_NAME,
    format_report_table,
    summary_table,
    write_chart,
    write_json,
)
from mlx_dualnorm.commands.bench.results import (
    BASELINE_PATH,
    DECODE_SCENARIOS,
    DECODE_TOKEN,
    FULL_ATTENTION_DECODE,
    GATED_DELTA_DECODE,
    GATED_DELTA_PREFILL,
    PREFILL_CALL,
    REPORT_SCHEMA,
    BenchmarkConfig,
    BenchmarkReport,
    Scenario,
)
from mlx_dualnorm.commands.shared.paths import (
    PATH_REGISTRY,
    PathUnavailable,
    package_mode_factory,
    refuse_unavailable,
    register_path,
    unavailable_paths,
)

__all__ = [
    "BenchmarkConfig",
    "BenchmarkReport",
    "CHART_FILE_NAME",
    "DECODE_SCENARIOS",
    "DECODE_TOKEN",
    "FULL_ATTENTION_DECODE",
    "GATED_DELTA_DECODE",
    "GATED_DELTA_PREFILL",
    "JSON_FILE_NAME",
    "PATH_REGISTRY",
    "PREFILL_CALL",
    "PathUnavailable",
    "REPORT_SCHEMA",
    "Scenario",
    "build_parser",
    "format_report_table",
    "interleaved_samples",
    "main",
    "package_mode_factory",
    "progress_to_stderr",
    "register_path",
    "run_benchmark",
    "summary_table",
    "write_chart",
    "write_json",
]


# ---- Command line -----------------------------------------------------------------------


# The bounds of the counts: each repeat holds one value per metric, and
# each decode token chains --layers calls into one graph held until it is
# evaluated, so these bound the run's memory (and its time).
MAX_REPEATS = 1000
MAX_LAYERS = 512
MAX_EPS = 1.0


def progress_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = command.tool_parser(
        "bench",
        "Time every path against the composed path (two mx.fast.rms_norm calls): host us "
        "per call, us per decode token, prefill time and peak memory. Every ratio is "
        "time(path) / time(composed): lower is better.",
    )
    parser.add_argument("--output-dir", type=command.output_folder, default=None,
                        help=f"write {JSON_FILE_NAME} and {CHART_FILE_NAME} into this folder "
                             "(created if missing; checked before the run)")
    parser.add_argument("--quick", action="store_true",
                        help="a few-second smoke run (fewer repeats and samples)")
    parser.add_argument("--repeats", type=command.Count(1, MAX_REPEATS), default=None,
                        help="repeats (default: 11, or 3 with --quick)")
    parser.add_argument("--layers", type=command.Count(1, MAX_LAYERS), default=48,
                        help="chained dual calls per decode token")
    parser.add_argument("--paths", default=None,
                        help=f"comma-separated paths (default: all of {', '.join(PATH_REGISTRY)}); "
                             f"{BASELINE_PATH} is always added")
    parser.add_argument("--eps", type=command.Number(0.0, MAX_EPS), default=1e-6, help="RMS epsilon")
    command.add_device_argument(parser)
    parser.add_argument("--no-plot", action="store_true",
                        help="with --output-dir, skip the PNG chart")
    parser.add_argument("--all-metrics", action="store_true",
                        help="also print the secondary metrics (release time, build part)")
    return parser


def _config_from_arguments(
    arguments: argparse.Namespace, parser: argparse.ArgumentParser
) -> BenchmarkConfig:
    overrides: dict[str, Any] = {"eps": arguments.eps, "layers": arguments.layers}
    if arguments.repeats is not None:
        overrides["repeats"] = arguments.repeats
    if arguments.paths:
        names = [name.strip() for name in arguments.paths.split(",")]
        if not all(names):
            parser.error(f"--paths: an empty name in {arguments.paths!r}")
        overrides["paths"] = tuple(dict.fromkeys(names))  # each path timed once
    config = BenchmarkConfig.quick(**overrides) if arguments.quick else BenchmarkConfig(**overrides)
    try:
        config.selected_paths()
    except ValueError as bad_paths:
        parser.error(str(bad_paths))
    if config.paths is not None:
        # A path asked for by name that cannot run here is refused (exit 2),
        # as parity and replay refuse it; left to the default, it is skipped.
        refuse_unavailable(unavailable_paths(config.paths, config.eps))
    return config


def _write_files(report: BenchmarkReport, output_dir: pathlib.Path, plot: bool) -> None:
    progress_to_stderr(f"wrote {write_json(report, output_dir)}")
    if not plot:
        return
    chart = write_chart(report, output_dir)
    if chart is None:
        progress_to_stderr("matplotlib is not installed: no PNG chart "
                           "(pip install 'mlx_dualnorm[plot]')")
    else:
        progress_to_stderr(f"wrote {chart}")


def _run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command.select_device(arguments.device, parser)
    config = _config_from_arguments(arguments, parser)
    try:
        report = run_benchmark(config, progress=progress_to_stderr)
    except command.InterruptedWithPartialResult as interrupted:
        partial = interrupted.partial
        if isinstance(partial, BenchmarkReport) and partial.config.repeats:
            print(format_report_table(partial, all_metrics=arguments.all_metrics))
        raise
    progress_to_stderr(f"benchmark took {report.elapsed_s:.1f} s")
    # The table first: a write that fails after the check (a full disk, a
    # folder removed meanwhile) loses nothing that was measured.
    print(format_report_table(report, all_metrics=arguments.all_metrics), flush=True)
    if arguments.output_dir is not None:
        try:
            _write_files(report, arguments.output_dir, plot=not arguments.no_plot)
        except OSError as failed:
            raise command.Unavailable(
                f"could not write into {arguments.output_dir}: {failed.strerror or failed}"
            ) from failed
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mlx_dualnorm bench``: prints the table; 2 on bad usage."""
    return command.run_tool(build_parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
