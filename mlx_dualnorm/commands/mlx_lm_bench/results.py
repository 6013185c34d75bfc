"""What the mlx-lm bench (:mod:`mlx_dualnorm.commands.mlx_lm_bench`) records and
how it prints: paired timings of mlx-lm's ``normalize_qk`` and the patch,
decode measurements at released models' dimensions, and their tables.

Every table gives each measurement's median time per round for both paths,
the ratio of the two medians (patched / unpatched: lower is better, below 1
the patch is faster) and the per-round ratios' min..max as its spread.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import mlx.core as mx

from mlx_dualnorm.commands.shared.command import ratio_of_medians, spread
from mlx_dualnorm.commands.shared.synthetic import DECODE_MODELS

__all__ = [
    "DECODE_DTYPE_OF_WEIGHTS",
    "DECODE_SHAPE",
    "DecodeMeasurement",
    "PATCHED",
    "PairedTiming",
    "UNPATCHED",
    "format_decode_table",
    "format_table",
]

UNPATCHED = "mlx-lm"
PATCHED = "patched"
DECODE_SHAPE = (1, 1, 16, 128)  # q and k at the Qwen3-Next decode shape, bfloat16
DECODE_DTYPE_OF_WEIGHTS = mx.bfloat16  # the dtype of the released checkpoints


@dataclasses.dataclass
class PairedTiming:
    """Per-round times of both paths, in ``unit``, and their ratios."""

    name: str
    unit: str
    unpatched: list[float]
    patched: list[float]

    def times_of(self, path: str) -> list[float]:
        return self.patched if path == PATCHED else self.unpatched

    @property
    def complete_rounds(self) -> int:
        return min(len(self.unpatched), len(self.patched))

    @property
    def time_ratios(self) -> list[float]:
        """Per round, patched time / unpatched time: lower is better."""
        return [p / u for u, p in zip(self.unpatched, self.patched) if u > 0]

    def summary(self) -> dict:
        return {
            "name": self.name,
            "unit": self.unit,
            "rounds": self.complete_rounds,
            "unpatched_time": spread(self.unpatched),
            "patched_time": spread(self.patched),
            # What the tables print: the ratio of the two medians, and the
            # per-round ratios as its spread.
            "time_ratio_of_medians": ratio_of_medians(self.patched, self.unpatched),
            "time_ratio_patched_over_unpatched": spread(self.time_ratios),
        }


@dataclasses.dataclass
class DecodeMeasurement:
    """One decode model's paired rounds, what it was, and whether every
    round's greedy tokens agreed."""

    model: str
    resembles: str
    config: dict
    quick_reduced: bool  # fewer layers and a smaller vocabulary than the real model
    prompt_tokens: int
    decode_steps: int
    timing: PairedTiming
    token_mismatch: Optional[str]  # None when every round gave the same tokens
    # What the patch engaged in the patched warm-up run (the patch's own
    # record): attention layers engaged / left, gated-delta calls folded.
    engaged: Optional[dict] = None

    def dimensions(self) -> dict:
        config = self.config
        dimensions = {
            name: config[name]
            for name in (
                "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            )
        }
        if config["model_type"] == "qwen3_next":
            interval = config["full_attention_interval"]
            dimensions["full_attention_layers"] = config["num_hidden_layers"] // interval
            dimensions["gated_delta_layers"] = (
                config["num_hidden_layers"] - dimensions["full_attention_layers"]
            )
        return dimensions

    def summary(self) -> dict:
        return {
            **self.timing.summary(),
            "model": self.model,
            "model_type": self.config["model_type"],
            "resembles": self.resembles,
            "dimensions": self.dimensions(),
            "weights_dtype": str(DECODE_DTYPE_OF_WEIGHTS).rsplit(".", 1)[-1],
            "quick_reduced": self.quick_reduced,
            "prompt_tokens": self.prompt_tokens,
            "decode_steps_per_round": self.decode_steps,
            "greedy_tokens_identical": self.token_mismatch is None,
            "token_mismatch": self.token_mismatch,
            "patch_engaged": self.engaged,
        }


# ---- Tables ------------------------------------------------------------------


def _table_header(first_column: str, width: int) -> str:
    return (
        f"{first_column:<{width}} {'unit':<9} {'unpatched':>10} {PATCHED:>10} {'ratio':>7}"
        "  (per-round min..max)"
    )


def _table_row(name: str, width: int, unit: str, summary: dict, ratio_digits: int) -> str:
    """One paired measurement: median times, their ratio, then the range of
    the per-round ratios, with ``ratio_digits`` decimals."""
    spread = summary["time_ratio_patched_over_unpatched"]
    return (
        f"{name:<{width}} {unit:<9} "
        f"{summary['unpatched_time']['median']:>10.3f} "
        f"{summary['patched_time']['median']:>10.3f} "
        f"{summary['time_ratio_of_medians']:>6.{ratio_digits}f}x  "
        f"({spread['min']:.{ratio_digits}f}..{spread['max']:.{ratio_digits}f}, "
        f"{summary['rounds']} rounds)"
    )


def format_table(timings: list[PairedTiming]) -> str:
    lines = [_table_header("measurement", 34)]
    lines += [
        _table_row(timing.name, 34, timing.unit, timing.summary(), ratio_digits=2)
        for timing in timings
    ]
    lines += [
        "columns: median time per round, unpatched (mlx-lm's normalize_qk) and patched "
        "(mlx_dualnorm.integrations.mlx_lm.patch());",
        "  ratio = median patched time / median unpatched time, then the per-round ratios' "
        "min..max: lower is better, below 1.00x the patch is faster",
        f"  prework_N_layers: N chained q/k normalizations at {DECODE_SHAPE} bfloat16, "
        "one eval per token",
        "  generation_MODEL_DTYPE: ms per decode token of a small random mlx-lm model",
    ]
    return "\n".join(lines)


def _dimensions_text(dimensions: dict) -> str:
    layers = f"{dimensions['num_hidden_layers']} layers"
    if "gated_delta_layers" in dimensions:
        layers += (
            f" ({dimensions['gated_delta_layers']} gated-delta, "
            f"{dimensions['full_attention_layers']} full-attention)"
        )
    return (
        f"{layers}, hidden {dimensions['hidden_size']}, MLP {dimensions['intermediate_size']}, "
        f"{dimensions['num_attention_heads']}/{dimensions['num_key_value_heads']} heads x "
        f"{dimensions['head_dim']}, vocabulary {dimensions['vocab_size']}"
    )


def _engaged_text(engaged: dict) -> str:
    attention = engaged["attention_layers_engaged"]
    text = (
        f"patch engaged: attention layers {attention}"
        + "".join(f" ({prework} {layers})" for prework, layers in engaged["by_prework"].items())
        + f", left to mlx-lm {engaged['attention_layers_left']}; "
        f"gated-delta calls folded {engaged['gated_delta_calls_folded']} (warm-up run)"
    )
    if attention == 0 and engaged["gated_delta_calls_folded"] == 0:
        text += "; NOTHING: the patch covers no layer of this model, the ratio is noise"
    return text


def format_decode_table(measurements: list[DecodeMeasurement], device: str) -> str:
    if not measurements:
        return ""
    first = measurements[0]
    lines = [
        f"decode, random bfloat16 weights at released models' dimensions, on {device}: "
        f"{first.prompt_tokens}-token prompt, then {first.decode_steps} greedy decode steps "
        "per round (KV cache, one eval per token)",
        _table_header("model", 16),
    ]
    for measurement in measurements:
        summary = measurement.summary()
        lines.append(_table_row(measurement.model, 16, "ms/token", summary, ratio_digits=3))
        lines.append(f"  like {measurement.resembles}: {_dimensions_text(summary['dimensions'])}")
        if measurement.quick_reduced:
            real = DECODE_MODELS[measurement.model].config
            lines.append(
                f"  QUICK: reduced from {real['num_hidden_layers']} layers and vocabulary "
                f"{real['vocab_size']}; not the real model's time per token"
            )
        if measurement.engaged is not None:
            lines.append("  " + _engaged_text(measurement.engaged))
        tokens = "identical" if measurement.token_mismatch is None else "MISMATCH"
        lines.append(f"  greedy tokens, patched vs unpatched, every round: {tokens}")
    lines.append(
        "  ratio = median patched / median unpatched time per decode token, then the "
        "per-round ratios' min..max: lower is better, below 1.000x the patch is faster"
    )
    return "\n".join(lines)
