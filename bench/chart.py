"""Draws the chart of a benchmark report, from its JSON alone.

The package's benchmark (``python -m mlx_dualnorm bench --output-dir DIR``)
writes ``DIR/benchmark.json``; this script draws it, without running
anything again:

    python bench/chart.py DIR_OR_JSON [--out PNG]

One bar chart per headline metric: a bar per path at its median over the
repeats, min-max whiskers, and the ratio of its median to the reference
path's median under its name. A quick run's title says so, in red. The PNG
goes beside the JSON as ``benchmark.png`` unless ``--out`` names one. Needs
matplotlib (the ``plot`` extra). Exit status 2, with one ``[chart]`` line,
without matplotlib or for a file that is not a benchmark report.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, Optional

from mlx_dualnorm.commands.bench import JSON_FILE_NAME, results  # what --output-dir writes
from mlx_dualnorm.commands.shared import command

CHART_FILE_NAME = "benchmark.png"
REFERENCE_COLOR = "tab:gray"
PATH_COLOR = "tab:blue"
# The kinds of number the table prints and the chart draws, as the package defines them.
HEADLINE_KINDS = frozenset(
    kind.name for kind in vars(results).values()
    if isinstance(kind, results.MetricKind) and kind.headline
)


class NotAReport(command.Unavailable):
    """The input cannot be read as a benchmark report: one line, exit 2."""


def load_report(location: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """The JSON file (``location`` or the benchmark.json in it) and its content."""
    path = location / JSON_FILE_NAME if location.is_dir() else location
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as failed:
        raise NotAReport(f"cannot read {path}: {failed.strerror or failed}") from failed
    except (ValueError, RecursionError) as failed:  # invalid JSON or text, nested too deep
        raise NotAReport(f"{path} is not JSON: {' '.join(str(failed).split())}") from failed
    schema = report.get("schema") if isinstance(report, dict) else None
    if schema != results.REPORT_SCHEMA:
        raise NotAReport(f"{path} is not a {results.REPORT_SCHEMA} report (schema: {schema!r})")
    return path, report


def draw_chart(report: dict) -> Any:
    """The report's chart as a matplotlib figure (the caller saves and closes it)."""
    import matplotlib.pyplot as pyplot
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    metrics = [metric for metric in report["metrics"].values() if metric["kind"] in HEADLINE_KINDS]
    reference = metrics[0]["reference_path"] if metrics else results.BASELINE_PATH
    rows = -(-len(metrics) // 3)
    figure, axes_grid = pyplot.subplots(max(rows, 1), 3, figsize=(15, 4 * max(rows, 1)),
                                        squeeze=False)
    for axes, metric in zip(axes_grid.flat, metrics):
        scale, unit = (2**20, "MiB") if metric["unit"] == "bytes" else (1, metric["unit"])
        entries = metric["paths"]
        reference_median = entries.get(metric["reference_path"], {}).get("median")
        medians = [entry["median"] / scale for entry in entries.values()]
        whiskers = [[abs(entry[end] - entry["median"]) / scale for entry in entries.values()]
                    for end in ("min", "max")]
        labels = [
            f"{path}\n{entry['median'] / reference_median:.2f}x"
            if reference_median is not None and reference_median > 0 else path
            for path, entry in entries.items()
        ]
        colors = [REFERENCE_COLOR if path == metric["reference_path"] else PATH_COLOR
                  for path in entries]
        axes.bar(labels, medians, yerr=whiskers, capsize=3, color=colors)
        axes.set_title(f"{metric['title']}\n{metric['scenario']}", fontsize=9)
        axes.set_ylabel(f"{unit} (lower is better)")
        axes.tick_params(axis="x", labelsize=7)
    for axes in list(axes_grid.flat)[len(metrics):]:
        axes.set_visible(False)
    metadata, config = report["metadata"], report["config"]
    quick = bool(config["quick_mode"])
    figure.suptitle(
        f"{'QUICK RUN (few samples, a smoke test): ' if quick else ''}mlx_dualnorm benchmark, "
        f"{metadata['device']} ({metadata['cpu_model']}, {metadata['cpu_cores']} cores), "
        f"MLX {metadata['mlx_version']}, {config['repeats']} repeats; lower is better",
        fontsize=10, color="tab:red" if quick else "black",
    )
    figure.legend(handles=[
        Patch(color=REFERENCE_COLOR, label=f"{reference}: the reference (ratio 1.00x)"),
        Patch(color=PATH_COLOR, label=f"another path; under its name: its median / "
              f"{reference}'s median"),
        Line2D([], [], color="black", marker="_", linestyle="-",
               label="bar: median over repeats; whisker: min-max over repeats"),
    ], loc="lower center", ncol=3, fontsize=8)
    figure.tight_layout(rect=(0, 0.06, 1, 1))  # room for the legend below the charts
    return figure


def _run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    path, report = load_report(arguments.report)
    try:
        import matplotlib
    except ImportError:
        raise command.Unavailable("matplotlib is not installed (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    try:
        figure = draw_chart(report)
    except (KeyError, TypeError, ValueError, AttributeError) as incomplete:
        raise NotAReport(f"{path} is not a complete {results.REPORT_SCHEMA} report "
                         f"({type(incomplete).__name__}: {incomplete})") from None
    destination = arguments.out or path.parent / CHART_FILE_NAME
    try:
        with command.writing(destination):
            destination.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(destination, dpi=110)
    except ValueError as failed:  # a file type matplotlib cannot write
        raise command.Unavailable(f"could not write {destination}: {failed}") from None
    finally:
        pyplot.close(figure)
    print(f"wrote {destination}", file=sys.stderr)
    return command.EXIT_OK


def main(argv: Optional[list[str]] = None) -> int:
    parser = command.ToolParser(prog="python bench/chart.py", operation="chart",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=command.DefaultShownOnceFormatter)
    parser.add_argument("report", type=pathlib.Path,
                        help=f"a folder holding {JSON_FILE_NAME}, or the JSON file itself")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help=f"the PNG to write (default: {CHART_FILE_NAME} beside the JSON)")
    return command.run_tool(parser, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
