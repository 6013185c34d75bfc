"""What ``mlx-lm-bench`` measures, in interleaved rounds of mlx-lm's code
and the patch: the q/k prework, small random models' generation and decode
of random bfloat16 models at released dimensions."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx_lm.models.gated_delta as gated_delta_module

from mlx_dualnorm import Mode
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.generation import (
    count_normalize_qk_calls, greedy_generate, timed_greedy_decode,
)
from mlx_dualnorm.commands.shared.synthetic import (
    DECODE_MODELS, DEFAULT_DTYPES, build_model, build_synthetic_model,
    decode_model_config, prompt_token_ids, synthetic_model_config,
)
from mlx_dualnorm.integrations import mlx_lm as integration

UNPATCHED = "mlx-lm"
PATCHED = "patched"
DECODE_SHAPE = (1, 1, 16, 128)  # q and k at the Qwen3-Next decode shape, bfloat16
DECODE_DTYPE_OF_WEIGHTS = mx.bfloat16  # the dtype of the released checkpoints
INV_SCALE = DECODE_SHAPE[-1] ** -0.5  # what qwen3_next / qwen3_5 pass
EPS = 1e-6
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


class GenerationMismatch(Exception):
    """A generation round gave other tokens than the first: the runs being
    timed no longer compute the same thing, so their times compare nothing."""


def _timed_rounds(
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


def run_prework(
    layers: int, tokens: int, repeats: int, mode: Optional[Mode], progress: StepReport
) -> PairedTiming:
    """Microseconds per token of ``layers`` chained q/k normalizations, one
    ``mx.eval`` per token; ``progress`` hears of each path's round."""
    query_key, key_key = mx.random.split(mx.random.key(DECODE_SHAPE[-1]))
    queries = mx.random.normal(DECODE_SHAPE, key=query_key).astype(mx.bfloat16)
    keys = mx.random.normal(DECODE_SHAPE, key=key_key).astype(mx.bfloat16)
    mx.eval(queries, keys)
    with integration.patch(mode):  # what mlx-lm's layers call while patched
        patched_normalize_qk = gated_delta_module.normalize_qk

    def seconds_per_token(patched: bool, tokens: int) -> float:
        normalize_qk = patched_normalize_qk if patched else integration.ORIGINAL_NORMALIZE_QK
        started = time.perf_counter()
        for _ in range(tokens):
            normalized_queries, normalized_keys = queries, keys
            for _ in range(layers):
                normalized_queries, normalized_keys = normalize_qk(
                    normalized_queries, normalized_keys, inv_scale=INV_SCALE, eps=EPS
                )
            mx.eval(normalized_queries, normalized_keys)
        return (time.perf_counter() - started) / tokens

    return _timed_rounds(
        PairedTiming(f"prework_{layers}_layers", "us/token", [], []), repeats,
        warm_up=lambda patched: seconds_per_token(patched, max(tokens // 10, 3)),
        measure=lambda patched, *_: 1e6 * seconds_per_token(patched, tokens),
        progress=progress,
    )


def run_generation(
    model_type: str, tokens: int, repeats: int, mode: Optional[Mode], progress: StepReport
) -> PairedTiming:
    """Milliseconds per decode token of a synthetic model, greedy through mlx-lm's
    ``generate_step``; every round's token ids must be the first's (else GenerationMismatch)."""
    model = build_synthetic_model(model_type)
    config = synthetic_model_config(model_type)
    prompt = prompt_token_ids((config.get("text_config") or config)["vocab_size"])
    expected_tokens: Optional[list[int]] = None

    def one_round(patched: bool, *_: object) -> float:
        nonlocal expected_tokens
        with integration.patch(mode) if patched else integration.unpatch():
            trace = greedy_generate(model, prompt, tokens)
        if expected_tokens is None:
            expected_tokens = trace.token_ids
        elif trace.token_ids != expected_tokens:
            raise GenerationMismatch(f"{model_type}: greedy token ids changed between rounds")
        return trace.median_decode_ms

    dtype_name = str(DEFAULT_DTYPES[model_type]).rsplit(".", 1)[-1]
    timing = PairedTiming(f"generation_{model_type}_{dtype_name}", "ms/token", [], [])
    return _timed_rounds(timing, repeats, one_round, one_round, progress)


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

    _timed_rounds(timing, rounds, warm_up, one_round, result=measurement)
    return measurement


def decode_progress_steps(steps: int, rounds: int) -> int:
    """How many tokens :func:`run_decode` reports: the warm-up runs', then
    every round's, both ways, the prefill's first token included."""
    return 2 * (WARM_UP_DECODE_STEPS + 1) + 2 * rounds * (steps + 1)
