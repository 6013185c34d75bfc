"""``python -m mlx_dualnorm bench``: every path timed against the composed
one (:func:`run_benchmark`); this module prints and writes a run: the full
table, the main job's summary and the JSON file."""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
from typing import Any, Optional, Sequence

from mlx_dualnorm.commands.bench.measurements import interleaved_samples, run_benchmark
from mlx_dualnorm.commands.bench.results import (
    BASELINE_PATH, DECODE_SCENARIOS, DECODE_TOKEN, FULL_ATTENTION_DECODE, GATED_DELTA_DECODE,
    GATED_DELTA_PREFILL, HOST_CALL, PREFILL_CALL, REPORT_SCHEMA, BenchmarkConfig,
    BenchmarkReport, MetricResult,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.command import progress_to_stderr
from mlx_dualnorm.commands.shared.paths import (
    PATH_REGISTRY, PathUnavailable, describe_paths, package_mode_factory, refuse_unavailable,
    register_path, unavailable_paths,
)

# The programmatic API of bench/README.md, and what the tests and bench/'s scripts import.
__all__ = [
    "BenchmarkConfig", "BenchmarkReport", "DECODE_SCENARIOS", "DECODE_TOKEN", "GATED_DELTA_DECODE",
    "GATED_DELTA_PREFILL", "JSON_FILE_NAME", "PATH_REGISTRY", "PREFILL_CALL", "PathUnavailable",
    "REPORT_SCHEMA", "build_parser", "format_report_table", "interleaved_samples", "main",
    "package_mode_factory", "progress_to_stderr", "register_path", "run_benchmark",
    "summary_table", "write_json",
]

JSON_FILE_NAME = "benchmark.json"


def write_json(report: BenchmarkReport, output_dir: os.PathLike | str) -> pathlib.Path:
    pathlib.Path(output_dir).mkdir(parents=True, exist_ok=True)
    return command.write_json(pathlib.Path(output_dir) / JSON_FILE_NAME, report.to_json())


def _table(rows: list[list[str]]) -> str:
    """The first column left-aligned, the others right-aligned, a rule under the head."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    aligned = [
        [row[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:]))]
        for row in rows
    ]
    rule = ["-" * width for width in widths]
    return "\n".join("  ".join(cells).rstrip() for cells in [aligned[0], rule, *aligned[1:]])


RATIO_NOTE = (
    f"ratio = this path's median time (or memory) / {BASELINE_PATH}'s median; "
    "lower is better, below 1.00x the path beats the composed path"
)


def _metric_cell(metric: Optional[MetricResult], path: str, with_range: bool) -> str:
    """The median over repeats, and the ratio of medians [min-max of the per-repeat ratios]."""
    if metric is None or not metric.samples.get(path):
        return "-"
    median = statistics.median(metric.samples[path])
    if metric.kind.unit == "bytes":
        cell = f"{median / 2**20:.2f} MiB"
    else:
        cell = f"{median:.1f}" if median >= 100 else f"{median:.2f}"
    ratio, ratios = metric.ratio_of_medians(path), metric.ratio_samples(path)
    if ratio is not None and path != BASELINE_PATH:
        cell += f" ({ratio:.2f}x"
        cell += f" [{min(ratios):.2f}-{max(ratios):.2f}])" if with_range and ratios else ")"
    return cell


def format_report_table(report: BenchmarkReport, *, all_metrics: bool = False) -> str:
    """Per metric and path, the median over repeats and the ratio to the
    baseline [min-max], then what each metric and path is."""
    config, metadata, paths = report.config, report.metadata, report.paths_ran()
    metrics = [metric for metric in report.metrics.values() if all_metrics or metric.kind.headline]
    rows = [["metric / scenario", *paths]] + [
        [f"{metric.kind.name} {metric.scenario.name}",
         *(_metric_cell(metric, path, True) for path in paths)]
        for metric in metrics
    ]
    heading = (
        f"mlx_dualnorm benchmark: {metadata['device']}, {metadata['cpu_model']} "
        f"({metadata['cpu_cores']} cores), MLX {metadata['mlx_version']}, "
        f"{config.repeats} repeats{' (quick)' if config.quick_mode else ''}, "
        f"{config.layers} layers/token"
    )
    if report.interrupted:
        heading += f"; INTERRUPTED: only the {config.repeats} repeats that completed"
    skipped = [
        f"  {name}: {entry.get('reason', '')}"
        for name, entry in report.path_status.items() if entry.get("status") != "ok"
    ]
    return "\n".join([
        heading,
        f"median over repeats (ratio to {BASELINE_PATH} [min-max of the per-repeat ratios]); "
        f"{RATIO_NOTE}",
        _table(rows),
        "metrics:",
        *(f"  {metric.kind.name} {metric.scenario.name}: {metric.kind.title}, "
          f"{metric.scenario.description}" for metric in metrics),
        "paths:", *(f"  {line}" for line in describe_paths(paths)),
        *(["skipped paths:", *skipped] if skipped else []),
    ])


SUMMARY_COLUMNS = (  # (kind, scenario, column title, what the column means)
    (HOST_CALL, GATED_DELTA_DECODE, "host us/call",
     "host us to build one dual call's graph (no evaluation), gated-delta decode shape"),
    (DECODE_TOKEN, GATED_DELTA_DECODE, "us/token gated-delta",
     "us per decode token of {layers} chained dual calls and one eval: "
     + GATED_DELTA_DECODE.description),
    (DECODE_TOKEN, FULL_ATTENTION_DECODE, "us/token full-attn",
     "the same at the " + FULL_ATTENTION_DECODE.description),
)


def summary_table(report: BenchmarkReport) -> str:
    """What ``python -m mlx_dualnorm`` prints after its parity check: per
    path, the SUMMARY_COLUMNS with their ratios, then what each column and path means."""
    config, metadata, paths = report.config, report.metadata, report.paths_ran()
    rows = [["path", *(title for _, _, title, _ in SUMMARY_COLUMNS)]] + [
        [path, *(_metric_cell(report.metrics.get(kind.key(scenario)), path, False)
                 for kind, scenario, _, _ in SUMMARY_COLUMNS)]
        for path in paths
    ]
    return "\n".join([
        f"performance on {metadata['device']} (MLX {metadata['mlx_version']}, "
        f"{'quick' if config.quick_mode else 'full'} run, median of {config.repeats} repeats), "
        f"time per path and its ratio to {BASELINE_PATH}:",
        _table(rows),
        "columns (lower is better):",
        *(f"  {title}: {meaning.format(layers=config.layers)}"
          for _, _, title, meaning in SUMMARY_COLUMNS),
        f"  (N.NNx): {RATIO_NOTE}",
        "paths:", *(f"  {line}" for line in describe_paths(paths)),
    ])


def build_parser() -> argparse.ArgumentParser:
    parser = command.tool_parser(
        "bench",
        "Time every path against the composed path (two mx.fast.rms_norm calls): host us "
        "per call, us per decode token, prefill time and peak memory. Every ratio is "
        "time(path) / time(composed): lower is better.",
    )
    add = parser.add_argument
    # The counts' bounds bound the run's memory (and time): each repeat holds
    # a value per metric, each decode token a graph of --layers calls.
    add("--output-dir", type=command.output_folder, default=None,
        help=f"write {JSON_FILE_NAME} into this folder "
             "(created if missing; checked before the run)")
    add("--quick", action="store_true", help="a few-second smoke run (fewer repeats and samples)")
    add("--repeats", type=command.Count(1, 1000), default=None,
        help="repeats (default: 11, or 3 with --quick)")
    add("--layers", type=command.Count(1, 512), default=48,
        help="chained dual calls per decode token")
    add("--paths", default=None,
        help=f"comma-separated paths (default: all of {', '.join(PATH_REGISTRY)}); "
             f"{BASELINE_PATH} is always added")
    add("--eps", type=command.Number(0.0, 1.0), default=1e-6, help="RMS epsilon")
    command.add_device_argument(parser)
    add("--all-metrics", action="store_true",
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
    if arguments.output_dir is None:
        return 0
    with command.writing(f"into {arguments.output_dir}"):
        progress_to_stderr(f"wrote {write_json(report, arguments.output_dir)}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mlx_dualnorm bench``: prints the table; 2 on bad usage."""
    return command.run_tool(build_parser(), _run, argv)
