"""What a benchmark run prints and writes: the JSON file, the PNG chart,
the full table and the short summary the package's main job prints.

Every table and chart shows each path's median over the repeats beside its
ratio to the composed path's median (lower is better), and says what each
path is.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
from typing import Optional, Sequence

from mlx_dualnorm.commands.bench.measurements import run_benchmark
from mlx_dualnorm.commands.shared.command import spread
from mlx_dualnorm.commands.bench.results import (
    BASELINE_PATH,
    DECODE_TOKEN,
    FULL_ATTENTION_DECODE,
    GATED_DELTA_DECODE,
    HOST_CALL,
    BenchmarkConfig,
    BenchmarkReport,
    MetricResult,
    metric_key,
)
from mlx_dualnorm.commands.shared.paths import describe_paths

__all__ = [
    "CHART_FILE_NAME",
    "JSON_FILE_NAME",
    "format_report_table",
    "summary_table",
    "write_chart",
    "write_json",
]

JSON_FILE_NAME = "benchmark.json"
CHART_FILE_NAME = "benchmark.png"


# ---- Output: JSON, chart, tables ------------------------------------------------------


def write_json(report: BenchmarkReport, output_dir: os.PathLike | str) -> pathlib.Path:
    directory = pathlib.Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    destination = directory / JSON_FILE_NAME
    destination.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return destination


def _headline_metrics(report: BenchmarkReport) -> list[MetricResult]:
    return [metric for metric in report.metrics.values() if metric.kind.headline]


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
    metrics = _headline_metrics(report)
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
        labels = []
        for path in paths:
            ratio = metric.ratio_of_medians(path)
            labels.append(path if ratio is None else f"{path}\n{ratio:.2f}x")
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
        loc="lower center",
        ncol=3,
        fontsize=8,
    )
    figure.tight_layout(rect=(0, 0.06, 1, 1))  # room for the legend below the charts
    directory = pathlib.Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    destination = directory / CHART_FILE_NAME
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


def _paths_legend(report: BenchmarkReport, paths: Sequence[str]) -> list[str]:
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
        *_paths_legend(report, paths),
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


def summary_table(report: Optional[BenchmarkReport] = None, *, eps: float = 1e-6) -> str:
    """A short per-path table (host us/call and us/token at both decode
    shapes, with ratios to the baseline), then what each column and path
    means. Without a report, runs the quick benchmark first (a few
    seconds): what ``python -m mlx_dualnorm`` prints after its parity check."""
    if report is None:
        report = run_benchmark(BenchmarkConfig.quick(eps=eps))
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
    return "\n".join([heading, _format_table(rows), *legend, *_paths_legend(report, paths)])
