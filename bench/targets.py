"""Judges a benchmark report against the project's performance goals.

The package's benchmark (``python -m mlx_dualnorm bench --output-dir DIR``)
measures and reports; whether a number is good enough is a judgement, not
a measurement, so the goals live here, outside the package:

    python bench/targets.py DIR/benchmark.json

Each goal bounds one path's metric on one device type, either as a ratio to
the composed path (the median over repeats of the per-repeat ratio, as the
report stores it) or as an absolute value in the metric's unit. Goals stated
for the other device type are not judged. Exit status 1 if a judged goal is
not met.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Optional

DECODE_SCENARIOS = ("decode_gated_delta", "decode_full_attention")


@dataclasses.dataclass(frozen=True)
class Goal:
    device_type: str  # "cpu" or "gpu"
    metric: str  # "kind/scenario", a key of the report's "metrics"
    path: str
    max_ratio: Optional[float] = None  # bound on ratio_to_composed's median
    max_value: Optional[float] = None  # bound on the value's median, in the metric's unit

    def __post_init__(self) -> None:
        if (self.max_ratio is None) == (self.max_value is None):
            raise ValueError(f"a goal sets exactly one of max_ratio and max_value: {self}")

    @property
    def name(self) -> str:
        if self.max_value is not None:
            return f"{self.metric}: {self.path} <= {self.max_value:g} (absolute)"
        return f"{self.metric}: {self.path} <= {self.max_ratio:g}x composed"


GOALS = (
    *(Goal("cpu", f"decode_us_per_token/{s}", "compiled", max_ratio=0.3) for s in DECODE_SCENARIOS),
    *(Goal("cpu", f"host_us_per_call/{s}", "compiled", max_ratio=1.0) for s in DECODE_SCENARIOS),
    *(Goal("gpu", f"decode_us_per_token/{s}", "compiled", max_ratio=1.0) for s in DECODE_SCENARIOS),
    *(Goal("gpu", f"host_us_per_call/{s}", "compiled", max_value=0.6) for s in DECODE_SCENARIOS),
    *(Goal(d, "prefill_peak_bytes/prefill_gated_delta", "compiled", max_ratio=1.0)
      for d in ("cpu", "gpu")),
    Goal("gpu", "decode_us_per_token/decode_gated_delta", "fused", max_ratio=0.5),
    Goal("gpu", "host_us_per_call/decode_gated_delta", "fused", max_value=1.0),
)


def judge(goal: Goal, report: dict) -> tuple[Optional[bool], Optional[dict]]:
    """(met, the judged min/median/max), or (None, None) where the path did
    not run at that metric."""
    entry = report["metrics"].get(goal.metric, {}).get("paths", {}).get(goal.path)
    if entry is None:
        return None, None
    if goal.max_value is not None:
        judged = {key: entry[key] for key in ("min", "median", "max")}
        return judged["median"] <= goal.max_value, judged
    ratio = entry.get("ratio_to_composed")
    if ratio is None:
        return None, None
    judged = {key: ratio[key] for key in ("min", "median", "max")}
    return judged["median"] <= goal.max_ratio, judged


def format_verdicts(report: dict, goals: tuple[Goal, ...] = GOALS) -> tuple[list[str], bool]:
    device_type = report["metadata"]["device_type"]
    lines, all_met = [f"goals for the {device_type.upper()} (lower is better):"], True
    for goal in goals:
        if goal.device_type != device_type:
            continue
        met, judged = judge(goal, report)
        if met is None or judged is None:
            lines.append(f"  [NOT MEASURED] {goal.name}: the path did not run")
            continue
        all_met = all_met and met
        unit = "" if goal.max_value is not None else "x"
        lines.append(
            f"  [{'met' if met else 'NOT MET'}] {goal.name}: measured "
            f"{judged['median']:.2f}{unit} [{judged['min']:.2f}-{judged['max']:.2f}]"
        )
    return lines, all_met


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=pathlib.Path, help="benchmark.json written by the bench")
    arguments = parser.parse_args(argv)
    report = json.loads(arguments.report.read_text(encoding="utf-8"))
    if report.get("schema") != "mlx_dualnorm.benchmark/2":
        parser.error(f"{arguments.report}: not a mlx_dualnorm.benchmark/2 report")
    lines, all_met = format_verdicts(report)
    print("\n".join(lines))
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
