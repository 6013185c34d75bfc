"""``python -m mlx_dualnorm bench``: the compiled dual head norm timed
against the paths it replaces, on the default MLX device.

Every path of :mod:`mlx_dualnorm.commands.shared.paths` (adding one is one
``register_path`` call; a factory or call that raises
:class:`PathUnavailable` skips the path instead of failing the run) is
measured per repeat: host us per call (graph build only), us per decode
token (``layers`` calls chained, one ``mx.eval``) at the two decode shapes,
and one prefill call's time and peak memory. Inside a repeat the paths take
their samples in turn, so load that comes and goes falls on all alike. A
ratio is ``value(path) / value(composed)``: lower is better; a table prints
the ratio of the two medians beside them, with the min-max of the
per-repeat ratios as its spread.

``main(argv)`` is the command line (``python -m mlx_dualnorm bench``);
``run_benchmark(config)`` the programmatic API (the measurements:
:mod:`~mlx_dualnorm.commands.bench.measurements`; what a run holds:
:mod:`~mlx_dualnorm.commands.bench.results`); this module prints and
writes it: the JSON file, the PNG chart, the full table and the short
summary the package's main job prints, each path's median over the
repeats beside its ratio to the composed path's median.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
from typing import Any, Optional, Sequence

from mlx_dualnorm.commands.bench.measurements import interleaved_samples, run_benchmark
from mlx_dualnorm.commands.bench.results import (
    BASELINE_PATH, DECODE_SCENARIOS, DECODE_TOKEN, FULL_ATTENTION_DECODE,
    GATED_DELTA_DECODE, GATED_DELTA_PREFILL, HOST_CALL, PREFILL_CALL, REPORT_SCHEMA,
    BenchmarkConfig, BenchmarkReport, MetricResult, Scenario, metric_key,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.command import spread
from mlx_dualnorm.commands.shared.paths import (
    PATH_REGISTRY, PathUnavailable, describe_paths, package_mode_factory,
    refuse_unavailable, register_path, unavailable_paths,
)

__all__ = [
    "BenchmarkConfig", "BenchmarkReport", "CHART_FILE_NAME", "DECODE_SCENARIOS",
    "DECODE_TOKEN", "FULL_ATTENTION_DECODE", "GATED_DELTA_DECODE", "GATED_DELTA_PREFILL",
    "JSON_FILE_NAME", "PATH_REGISTRY", "PREFILL_CALL", "PathUnavailable", "REPORT_SCHEMA",
    "Scenario", "build_parser", "format_report_table", "interleaved_samples", "main",
    "package_mode_factory", "progress_to_stderr", "register_path", "run_benchmark",
    "summary_table", "write_chart", "write_json",
]


# ---- Output: JSON, chart, tables ------------------------------------------------------


JSON_FILE_NAME = "benchmark.json"
CHART_FILE_NAME = "benchmark.png"


def write_json(report: BenchmarkReport, output_dir: os.PathLike | str) -> pathlib.Path:
    directory = pathlib.Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    destination = directory / JSON_FILE_NAME
    destination.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return destination


BASELINE_COLOR = "tab:gray"
PATH_COLOR = "tab:blue"


def write_chart(report: BenchmarkReport, output_dir: os.PathLike | str) -> Optional[pathlib.Path]:
    """A bar chart per headline metric: the median, min-max whiskers, the
    ratio of medians to the baseline under each path's name; a legend for
    every colour and the whiskers, "lower is better", and a QUICK RUN mark
    on a --quick run. None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        return None
    metrics = [metric for metric in report.metrics.values() if metric.kind.headline]
    columns = 3
    rows = -(-len(metrics) // columns)
    figure, axes_grid = pyplot.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    for axes, metric in zip(axes_grid.flat, metrics):
        paths = list(metric.samples)
        scale, unit = (2**20, "MiB") if metric.kind.unit == "bytes" else (1, metric.kind.unit)
        summaries = [spread(metric.samples[path]) for path in paths]
        medians = [summary["median"] / scale for summary in summaries]
        whiskers = [
            [(summary["median"] - summary["min"]) / scale for summary in summaries],
            [(summary["max"] - summary["median"]) / scale for summary in summaries],
        ]
        ratios = [metric.ratio_of_medians(path) for path in paths]
        labels = [path if r is None else f"{path}\n{r:.2f}x" for path, r in zip(paths, ratios)]
        colors = [BASELINE_COLOR if path == BASELINE_PATH else PATH_COLOR for path in paths]
        axes.bar(labels, medians, yerr=whiskers, capsize=3, color=colors)
        axes.set_title(f"{metric.kind.title}\n{metric.scenario.name}", fontsize=9)
        axes.set_ylabel(f"{unit} (lower is better)")
        axes.tick_params(axis="x", labelsize=7)
    for axes in list(axes_grid.flat)[len(metrics):]:
        axes.set_visible(False)
    metadata = report.metadata
    quick_mark = "QUICK RUN (few samples, a smoke test): " if report.config.quick_mode else ""
    figure.suptitle(
        f"{quick_mark}mlx_dualnorm benchmark, {metadata['device']} ({metadata['cpu_model']}, "
        f"{metadata['cpu_cores']} cores), MLX {metadata['mlx_version']}, "
        f"{report.config.repeats} repeats; lower is better",
        fontsize=10,
        color="tab:red" if report.config.quick_mode else "black",
    )
    figure.legend(
        handles=[
            Patch(color=BASELINE_COLOR, label=f"{BASELINE_PATH}: the reference (ratio 1.00x)"),
            Patch(color=PATH_COLOR, label="another path; under its name: its median / "
                  f"{BASELINE_PATH}'s median"),
            Line2D([], [], color="black", marker="_", linestyle="-",
                   label="bar: median over repeats; whisker: min-max over repeats"),
        ],
        loc="lower center", ncol=3, fontsize=8,
    )
    figure.tight_layout(rect=(0, 0.06, 1, 1))  # room for the legend below the charts
    pathlib.Path(output_dir).mkdir(parents=True, exist_ok=True)
    destination = pathlib.Path(output_dir) / CHART_FILE_NAME
    figure.savefig(destination, dpi=110)
    pyplot.close(figure)
    return destination


def _format_value(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / 2**20:.2f} MiB"
    return f"{value:.1f}" if value >= 100 else f"{value:.2f}"


def _format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:])
        ]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _ratio_note() -> str:
    return (
        f"ratio = this path's median time (or memory) / {BASELINE_PATH}'s median; "
        "lower is better, below 1.00x the path beats the composed path"
    )


def _paths_legend(paths: Sequence[str]) -> list[str]:
    return ["paths:", *(f"  {line}" for line in describe_paths(list(paths)))]


def _run_heading(report: BenchmarkReport) -> str:
    metadata, config = report.metadata, report.config
    heading = (
        f"mlx_dualnorm benchmark: {metadata['device']}, {metadata['cpu_model']} "
        f"({metadata['cpu_cores']} cores), MLX {metadata['mlx_version']}, "
        f"{config.repeats} repeats{' (quick)' if config.quick_mode else ''}, "
        f"{config.layers} layers/token"
    )
    if report.interrupted:
        heading += f"; INTERRUPTED: only the {config.repeats} repeats that completed"
    return heading


def _metric_cell(
    metric: Optional[MetricResult], path: str, unit: str, with_range: bool
) -> str:
    """The median over repeats, and for a path other than the baseline the
    ratio of its median to the baseline's median (the two numbers shown),
    with the min-max of the per-repeat ratios as its spread."""
    values = None if metric is None else metric.samples.get(path)
    if metric is None or not values:
        return "-"
    cell = _format_value(statistics.median(values), unit)
    ratio = metric.ratio_of_medians(path)
    ratios = metric.ratio_samples(path)
    if ratio is not None and path != BASELINE_PATH:
        cell += f" ({ratio:.2f}x"
        cell += f" [{min(ratios):.2f}-{max(ratios):.2f}])" if with_range and ratios else ")"
    return cell


def format_report_table(report: BenchmarkReport, *, all_metrics: bool = False) -> str:
    """The full text table: per metric and path, the median over repeats and
    the ratio to the baseline (median [min-max] over repeats), then what
    each path is."""
    paths = [name for name in report.path_status if report.ran(name)]
    rows = [["metric / scenario", *paths]]
    for metric in report.metrics.values():
        if all_metrics or metric.kind.headline:
            cells = [_metric_cell(metric, path, metric.kind.unit, True) for path in paths]
            rows.append([f"{metric.kind.name} {metric.scenario.name}", *cells])
    lines = [
        _run_heading(report),
        f"median over repeats (ratio to {BASELINE_PATH} [min-max of the per-repeat ratios]); "
        f"{_ratio_note()}",
        _format_table(rows),
        "metrics:",
        *(
            f"  {metric.kind.name} {metric.scenario.name}: {metric.kind.title}, "
            f"{metric.scenario.description}"
            for metric in report.metrics.values()
            if all_metrics or metric.kind.headline
        ),
        *_paths_legend(paths),
    ]
    skipped = [
        f"  {name}: {entry.get('reason', '')}"
        for name, entry in report.path_status.items()
        if entry.get("status") != "ok"
    ]
    if skipped:
        lines += ["skipped paths:", *skipped]
    return "\n".join(lines)


SUMMARY_COLUMNS = (
    (HOST_CALL, GATED_DELTA_DECODE, "host us/call",
     "host us to build one dual call's graph (no evaluation), gated-delta decode shape"),
    (DECODE_TOKEN, GATED_DELTA_DECODE, "us/token gated-delta",
     "us per decode token of {layers} chained dual calls and one eval: " + GATED_DELTA_DECODE.description),
    (DECODE_TOKEN, FULL_ATTENTION_DECODE, "us/token full-attn",
     "the same at the " + FULL_ATTENTION_DECODE.description),
)
"""(kind, scenario, column title, what the column means) of the summary."""


def summary_table(report: BenchmarkReport) -> str:
    """A short per-path table (host us/call and us/token at both decode
    shapes, with ratios to the baseline), then what each column and path
    means: what ``python -m mlx_dualnorm`` prints after its parity check."""
    rows = [["path", *(title for _, _, title, _ in SUMMARY_COLUMNS)]]
    paths = [path for path in report.path_status if report.ran(path)]
    for path in paths:
        cells = [
            _metric_cell(report.metrics.get(metric_key(kind, scenario)), path, kind.unit, False)
            for kind, scenario, _, _ in SUMMARY_COLUMNS
        ]
        rows.append([path, *cells])
    metadata = report.metadata
    heading = (
        f"performance on {metadata['device']} (MLX {metadata['mlx_version']}, "
        f"{'quick' if report.config.quick_mode else 'full'} run, median of "
        f"{report.config.repeats} repeats), time per path and its ratio to {BASELINE_PATH}:"
    )
    legend = [
        "columns (lower is better):",
        *(
            f"  {title}: {meaning.format(layers=report.config.layers)}"
            for _, _, title, meaning in SUMMARY_COLUMNS
        ),
        f"  (N.NNx): {_ratio_note()}",
    ]
    return "\n".join([heading, _format_table(rows), *legend, *_paths_legend(paths)])


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
                           "(pip install matplotlib)")
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
