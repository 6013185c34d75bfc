"""What ``mlx-lm-bench`` measures, and its tables. Each measurement is
``repeats`` rounds with mlx-lm's code and the patch interleaved (the order
alternating per round, so drift hits both alike), reported as the median
over rounds with the per-round ratios ``patched / unpatched`` (lower is
better) as its spread:

* :func:`run_prework`: the q/k normalization alone at the Qwen3-Next decode
  shape (q and k ``(1, 1, 16, 128)`` bfloat16) through ``layers`` chained
  gated-delta layers, one ``mx.eval`` per token: us per token;
* :func:`run_generation`: ms per decode token of the small random models of
  :mod:`~mlx_dualnorm.commands.shared.synthetic`, greedy through mlx-lm's
  ``generate_step`` (tiny models: the prework is a larger share of a token);
* :func:`run_decode`: ms per decode token of random bfloat16 models at the
  dimensions of released checkpoints (``DECODE_MODELS``), with what the
  patch engaged in each; every round's greedy tokens must equal the first
  unpatched round's. ``quick`` keeps the layer shapes with fewer layers and
  a smaller vocabulary, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import mlx_lm.models.gated_delta as gated_delta_module

from mlx_dualnorm import Mode
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.command import ratio_of_medians, spread
from mlx_dualnorm.commands.shared.generation import (
    count_normalize_qk_calls,
    greedy_generate,
    timed_greedy_decode,
)
from mlx_dualnorm.integrations.mlx_lm import recording
from mlx_dualnorm.commands.shared.synthetic import (
    DECODE_MODELS, DEFAULT_DTYPES, build_model, build_synthetic_model,
    decode_model_config, prompt_token_ids, synthetic_model_config,
)
from mlx_dualnorm.integrations import mlx_lm as integration

__all__ = [
    "DECODE_DTYPE_OF_WEIGHTS", "DECODE_SHAPE", "DecodeMeasurement", "GenerationMismatch",
    "PATCHED", "PairedTiming", "UNPATCHED", "decode_progress_steps", "first_token_mismatch",
    "run_decode", "run_generation", "run_prework",
]

UNPATCHED = "mlx-lm"
PATCHED = "patched"
DECODE_SHAPE = (1, 1, 16, 128)  # q and k at the Qwen3-Next decode shape, bfloat16
DECODE_DTYPE_OF_WEIGHTS = mx.bfloat16  # the dtype of the released checkpoints
DECODE_DTYPE = mx.bfloat16
HEAD_WIDTH = DECODE_SHAPE[-1]
INV_SCALE = HEAD_WIDTH**-0.5  # what qwen3_next / qwen3_5 pass
EPS = 1e-6
DECODE_PROMPT_TOKENS = 16
QUICK_DECODE_VOCABULARY = 8192  # the real 151936 makes a quick build slow on 2 cores
WARM_UP_DECODE_STEPS = 2

NormalizeQk = Callable[..., "tuple[mx.array, mx.array]"]
StepReport = Callable[[str], None]
"""Called after each step of a measurement with what the step was."""


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


# ---- The measurements ----------------------------------------------------------


class GenerationMismatch(Exception):
    """A generation round gave other tokens than the first: the runs being
    timed no longer compute the same thing, so their times compare nothing."""


def _report(progress: Optional[StepReport], detail: str) -> None:
    if progress is not None:
        progress(detail)


def _paired_rounds(rounds: int) -> Iterator[tuple[int, bool]]:
    """``(round index, patched)`` in run order: each round runs both paths,
    the first one alternating (round 0 unpatched first), so neither path
    always runs on what the other just warmed."""
    for round_index in range(rounds):
        for patched in (False, True) if round_index % 2 == 0 else (True, False):
            yield round_index, patched


@contextlib.contextmanager
def _partial_on_interrupt(partial: object) -> Iterator[None]:
    """Ctrl-C inside the block raises InterruptedWithPartialResult carrying
    ``partial``, the result being filled in, so the rounds done are printed."""
    try:
        yield
    except command.InterruptedWithPartialResult:
        raise
    except KeyboardInterrupt:
        raise command.InterruptedWithPartialResult(partial) from None


# ---- Prework at the decode shape ---------------------------------------------


def _decode_inputs() -> tuple[mx.array, mx.array]:
    key = mx.random.key(HEAD_WIDTH)
    query_key, key_key = mx.random.split(key)
    queries = mx.random.normal(DECODE_SHAPE, key=query_key).astype(DECODE_DTYPE)
    keys = mx.random.normal(DECODE_SHAPE, key=key_key).astype(DECODE_DTYPE)
    mx.eval(queries, keys)
    return queries, keys


def _prework_seconds_per_token(
    normalize_qk: NormalizeQk, queries: mx.array, keys: mx.array, layers: int, tokens: int
) -> float:
    started = time.perf_counter()
    for _ in range(tokens):
        normalized_queries, normalized_keys = queries, keys
        for _ in range(layers):
            normalized_queries, normalized_keys = normalize_qk(
                normalized_queries, normalized_keys, inv_scale=INV_SCALE, eps=EPS
            )
        mx.eval(normalized_queries, normalized_keys)
    return (time.perf_counter() - started) / tokens


def run_prework(
    layers: int,
    tokens: int = 200,
    repeats: int = 7,
    mode: Optional[Mode] = None,
    progress: Optional[StepReport] = None,
) -> PairedTiming:
    """Microseconds per token of ``layers`` chained q/k normalizations.
    ``progress`` hears of each path's round; on Ctrl-C the rounds so far
    come with the interrupt (:class:`~mlx_dualnorm.commands.shared.command.InterruptedWithPartialResult`)."""
    queries, keys = _decode_inputs()
    with integration.patch(mode):  # what mlx-lm's layers call while patched
        patched = gated_delta_module.normalize_qk
    paths = {UNPATCHED: integration.ORIGINAL_NORMALIZE_QK, PATCHED: patched}
    timing = PairedTiming(f"prework_{layers}_layers", "us/token", [], [])
    with _partial_on_interrupt(timing):
        for normalize_qk in paths.values():  # warm-up: traces, folds, allocator
            _prework_seconds_per_token(normalize_qk, queries, keys, layers, max(tokens // 10, 3))
        for round_index, patched in _paired_rounds(repeats):
            name = PATCHED if patched else UNPATCHED
            seconds = _prework_seconds_per_token(paths[name], queries, keys, layers, tokens)
            timing.times_of(name).append(1e6 * seconds)
            _report(progress, f"round {round_index + 1}/{repeats} {name}")
    return timing


# ---- Generation with the small models ---------------------------------------


def run_generation(
    model_type: str,
    tokens: int = 64,
    repeats: int = 3,
    mode: Optional[Mode] = None,
    dtype: Optional[mx.Dtype] = None,
    progress: Optional[StepReport] = None,
) -> PairedTiming:
    """Milliseconds per decode token of a synthetic model, unpatched vs
    patched; the token ids of every round must be the same. ``progress``
    and Ctrl-C as for :func:`run_prework`."""
    model = build_synthetic_model(model_type, dtype=dtype)
    prompt = prompt_token_ids(_vocabulary_size(model_type))
    expected_tokens: Optional[list[int]] = None

    def one_round(patched: bool) -> float:
        nonlocal expected_tokens
        with integration.patch(mode) if patched else integration.unpatch():
            trace = greedy_generate(model, prompt, tokens)
        if expected_tokens is None:
            expected_tokens = trace.token_ids
        elif trace.token_ids != expected_tokens:
            raise GenerationMismatch(f"{model_type}: greedy token ids changed between rounds")
        return trace.median_decode_ms

    dtype_name = str(dtype or DEFAULT_DTYPES[model_type]).rsplit(".", 1)[-1]
    timing = PairedTiming(f"generation_{model_type}_{dtype_name}", "ms/token", [], [])
    with _partial_on_interrupt(timing):
        for patched in (False, True):  # warm-up: mlx-lm's compiled helpers, folds
            one_round(patched)
        for round_index, patched in _paired_rounds(repeats):
            name = PATCHED if patched else UNPATCHED
            timing.times_of(name).append(one_round(patched))
            _report(progress, f"round {round_index + 1}/{repeats} {name}")
    return timing


def _vocabulary_size(model_type: str) -> int:
    config = synthetic_model_config(model_type)
    return (config.get("text_config") or config)["vocab_size"]


# ---- Decode at the dimensions of released models -----------------------------


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
    """Milliseconds per decode token of ``DECODE_MODELS[model]`` in
    bfloat16, unpatched vs patched, ``rounds`` paired rounds of ``steps``
    steps. ``quick`` builds the model with its ``quick_layers`` and a
    ``QUICK_DECODE_VOCABULARY``; ``config`` (tests) replaces the config.
    ``progress`` hears of every token (:func:`decode_progress_steps` of
    them); on Ctrl-C the rounds so far come with the interrupt. With an
    ``mx.distributed`` ``group``, the model is tensor-parallel over it
    (``Model.shard``)."""
    spec = DECODE_MODELS[model]
    if config is None:
        config = (
            decode_model_config(
                model, layers=spec.quick_layers, vocab_size=QUICK_DECODE_VOCABULARY
            )
            if quick
            else decode_model_config(model)
        )
    network = build_model(config, dtype=DECODE_DTYPE_OF_WEIGHTS)
    if group is not None:
        network.shard(group)
    prompt = prompt_token_ids(config["vocab_size"], DECODE_PROMPT_TOKENS)

    def one_run(patched: bool, run_steps: int, detail: str) -> tuple[list[int], float]:
        with integration.patch(mode) if patched else integration.unpatch():
            return timed_greedy_decode(network, prompt, run_steps, progress, detail)

    def warm_up_recording_engagement() -> None:
        """The patched warm-up, with what the patch engaged in it."""
        with integration.patch(mode), count_normalize_qk_calls() as calls, \
                recording() as record:
            timed_greedy_decode(
                network, prompt, WARM_UP_DECODE_STEPS, progress, f"warm-up {PATCHED}"
            )
            engagement = record.engagement(network)
        measurement.engaged = {
            "attention_layers_engaged": engagement.engaged_layers,
            "attention_layers_left": engagement.left_layers,
            "by_prework": engagement.engaged_by_prework(),
            "gated_delta_calls_folded": calls.folded,
        }

    measurement = DecodeMeasurement(
        model=model,
        resembles=spec.resembles,
        config=config,
        quick_reduced=config != decode_model_config(model),
        prompt_tokens=DECODE_PROMPT_TOKENS,
        decode_steps=steps,
        timing=PairedTiming(f"decode_{model}_bfloat16", "ms/token", [], []),
        token_mismatch=None,
    )
    reference_tokens: Optional[list[int]] = None
    with _partial_on_interrupt(measurement):
        # warm-up: compiled helpers, folds, allocator
        one_run(False, WARM_UP_DECODE_STEPS, f"warm-up {UNPATCHED}")
        warm_up_recording_engagement()
        for round_index, patched in _paired_rounds(rounds):
            path = PATCHED if patched else UNPATCHED
            token_ids, milliseconds = one_run(
                patched, steps, f"round {round_index + 1}/{rounds} {path}"
            )
            measurement.timing.times_of(path).append(milliseconds)
            if reference_tokens is None:  # round 0 runs unpatched first
                reference_tokens = token_ids
            difference = first_token_mismatch(reference_tokens, token_ids)
            if difference is not None and measurement.token_mismatch is None:
                measurement.token_mismatch = (
                    f"round {round_index}, {PATCHED if patched else 'unpatched'}: {difference}"
                )
    return measurement


def decode_progress_steps(steps: int, rounds: int) -> int:
    """How many tokens :func:`run_decode` reports: the warm-up runs', then
    every round's, both ways, the prefill's first token included."""
    return 2 * (WARM_UP_DECODE_STEPS + 1) + 2 * rounds * (steps + 1)
