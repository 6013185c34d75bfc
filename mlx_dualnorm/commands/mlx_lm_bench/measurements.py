"""What ``mlx-lm-bench`` measures, in interleaved rounds of mlx-lm's code
and the patch: decode of random bfloat16 models at released dimensions."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import mlx.core as mx

from mlx_dualnorm import Mode
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.generation import (
    count_normalize_qk_calls, timed_greedy_decode,
)
from mlx_dualnorm.commands.shared.synthetic import (
    DECODE_MODELS, build_model, decode_model_config, prompt_token_ids,
)
from mlx_dualnorm.integrations import mlx_lm as integration

UNPATCHED = "mlx-lm"
PATCHED = "patched"
DECODE_DTYPE_OF_WEIGHTS = mx.bfloat16  # the dtype of the released checkpoints
DECODE_PROMPT_TOKENS = 16
QUICK_DECODE_VOCABULARY = 8192  # the real 151936 makes a quick build slow on 2 cores
WARM_UP_DECODE_STEPS = 2

StepReport = Callable[[str], None]  # hears of each step of a measurement: what it was


@dataclasses.dataclass
class PairedTiming:
    """Per-round times of both paths, in ``unit``, and their ratios."""

    name: str
    unit: str
    unpatched: list[float]
    patched: list[float]

    @property
    def complete_rounds(self) -> int:
        return min(len(self.unpatched), len(self.patched))

    @property
    def time_ratios(self) -> list[float]:
        """Per round, patched time / unpatched time: lower is better."""
        return [p / u for u, p in zip(self.unpatched, self.patched) if u > 0]

    def summary(self) -> dict:
        return {
            "name": self.name, "unit": self.unit, "rounds": self.complete_rounds,
            "unpatched_time": command.spread(self.unpatched),
            "patched_time": command.spread(self.patched),
            # What the tables print: the ratio of the two medians, the per-round ratios its spread.
            "time_ratio_of_medians": command.ratio_of_medians(self.patched, self.unpatched),
            "time_ratio_patched_over_unpatched": command.spread(self.time_ratios),
        }


@dataclasses.dataclass
class DecodeMeasurement:
    """One decode model's paired rounds, what it was, and whether all greedy tokens agreed."""

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
        names = ("hidden_size", "num_hidden_layers", "intermediate_size",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
        dimensions = {name: config[name] for name in names}
        if config["model_type"] == "qwen3_next":
            full_attention = config["num_hidden_layers"] // config["full_attention_interval"]
            dimensions["full_attention_layers"] = full_attention
            dimensions["gated_delta_layers"] = config["num_hidden_layers"] - full_attention
        return dimensions

    def summary(self) -> dict:
        return {
            **self.timing.summary(),
            "model": self.model, "model_type": self.config["model_type"],
            "resembles": self.resembles, "dimensions": self.dimensions(),
            "weights_dtype": str(DECODE_DTYPE_OF_WEIGHTS).rsplit(".", 1)[-1],
            "quick_reduced": self.quick_reduced, "prompt_tokens": self.prompt_tokens,
            "decode_steps_per_round": self.decode_steps,
            "greedy_tokens_identical": self.token_mismatch is None,
            "token_mismatch": self.token_mismatch, "patch_engaged": self.engaged,
        }


def timed_rounds(
    timing: PairedTiming, rounds: int, warm_up: Callable[[bool], object],
    measure: Callable[[bool, int, str], float], progress: Optional[StepReport] = None,
    result: object = None,
) -> PairedTiming:
    """``warm_up(patched)`` both ways, then ``rounds`` rounds of ``measure(patched, round,
    label)`` into ``timing``, round 0 unpatched first and the order alternating after, so
    neither path always runs on what the other just warmed. Ctrl-C raises
    InterruptedWithPartialResult with ``result`` or ``timing`` (None before a complete round)."""
    try:
        for patched in (False, True):
            warm_up(patched)
        for round_index in range(rounds):
            for patched in (False, True) if round_index % 2 == 0 else (True, False):
                label = f"round {round_index + 1}/{rounds} {PATCHED if patched else UNPATCHED}"
                times = timing.patched if patched else timing.unpatched
                times.append(measure(patched, round_index, label))
                if progress is not None:
                    progress(label)
    except KeyboardInterrupt:
        partial = (timing if result is None else result) if timing.complete_rounds else None
        raise command.InterruptedWithPartialResult(partial) from None
    return timing


def first_token_mismatch(expected: list[int], actual: list[int]) -> Optional[str]:
    """None when the two greedy token lists are equal, else where they
    first differ (or where the shorter one ends)."""
    for step, (expected_id, actual_id) in enumerate(zip(expected, actual)):
        if expected_id != actual_id:
            return f"step {step}: token {actual_id}, expected {expected_id}"
    if len(expected) != len(actual):
        return f"{len(actual)} tokens, expected {len(expected)}"
    return None


def run_decode(
    model: str, steps: int = 32, rounds: int = 5, mode: Optional[Mode] = None,
    quick: bool = False, config: Optional[dict] = None, progress: Optional[StepReport] = None,
    group: Any = None,
) -> DecodeMeasurement:
    """Milliseconds per decode token of ``DECODE_MODELS[model]`` in bfloat16, every round's
    greedy tokens compared with the first (unpatched) round's. ``quick``: fewer layers, a
    smaller vocabulary; ``config`` (tests) replaces the config; a ``group`` shards the model."""
    spec = DECODE_MODELS[model]
    if config is None:
        reduced = {"layers": spec.quick_layers, "vocab_size": QUICK_DECODE_VOCABULARY}
        config = decode_model_config(model, **(reduced if quick else {}))
    network = build_model(config, dtype=DECODE_DTYPE_OF_WEIGHTS)
    if group is not None:
        network.shard(group)
    prompt = prompt_token_ids(config["vocab_size"], DECODE_PROMPT_TOKENS)
    timing = PairedTiming(f"decode_{model}_bfloat16", "ms/token", [], [])
    measurement = DecodeMeasurement(
        model, spec.resembles, config, config != decode_model_config(model),
        DECODE_PROMPT_TOKENS, steps, timing, token_mismatch=None,
    )

    def warm_up(patched: bool) -> None:
        """The patched warm-up also records what the patch engaged."""
        detail = f"warm-up {PATCHED if patched else UNPATCHED}"
        if not patched:
            with integration.unpatch():
                timed_greedy_decode(network, prompt, WARM_UP_DECODE_STEPS, progress, detail)
            return
        with integration.patch(mode), count_normalize_qk_calls() as calls, \
                integration.recording() as record:
            timed_greedy_decode(network, prompt, WARM_UP_DECODE_STEPS, progress, detail)
            engagement = record.engagement(network)
        measurement.engaged = {
            "attention_layers_engaged": engagement.engaged_layers,
            "attention_layers_left": engagement.left_layers,
            "by_prework": engagement.engaged_by_prework(),
            "gated_delta_calls_folded": calls.folded,
        }

    reference_tokens: Optional[list[int]] = None

    def one_round(patched: bool, round_index: int, label: str) -> float:
        nonlocal reference_tokens
        with integration.patch(mode) if patched else integration.unpatch():
            token_ids, milliseconds = timed_greedy_decode(network, prompt, steps, progress, label)
        if reference_tokens is None:  # round 0 runs unpatched first
            reference_tokens = token_ids
        difference = first_token_mismatch(reference_tokens, token_ids)
        if difference is not None and measurement.token_mismatch is None:
            path = PATCHED if patched else "unpatched"
            measurement.token_mismatch = f"round {round_index}, {path}: {difference}"
        return milliseconds

    timed_rounds(timing, rounds, warm_up, one_round, result=measurement)
    return measurement


def decode_progress_steps(steps: int, rounds: int) -> int:
    """How many tokens :func:`run_decode` reports: the warm-up runs', then
    every round's, both ways, the prefill's first token included."""
    return 2 * (WARM_UP_DECODE_STEPS + 1) + 2 * rounds * (steps + 1)
