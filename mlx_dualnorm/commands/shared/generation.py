"""Greedy generation through mlx-lm's own ``generate_step``, recorded: the
tokens, every step's logits and wall times (:func:`greedy_generate`); two
such runs compared token for token and bit for bit
(:func:`compare_traces`); and what the patch counted while a block ran
(:func:`count_normalize_qk_calls`, :func:`count_package_calls`), read from
its public :func:`~mlx_dualnorm.integrations.mlx_lm.report`. Shared by
``mlx-lm-check`` and ``mlx-lm-bench``; imports mlx-lm."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm.bits import same_bits
from mlx_dualnorm.integrations import mlx_lm as integration

__all__ = [
    "AttentionLayerCounts", "GreedyTrace", "NormalizeQkCallCounts", "TraceComparison",
    "compare_traces", "count_normalize_qk_calls", "count_package_calls", "greedy_generate",
    "timed_greedy_decode",
]


# ---- Greedy generation through mlx-lm -------------------------------------


@dataclasses.dataclass
class GreedyTrace:
    """One greedy generation: the yielded token ids, the raw logits of every
    model step (one more than tokens: generate_step computes the step after
    the last yielded token too), and wall times."""

    token_ids: list[int]
    step_logits: list[mx.array]
    first_token_seconds: float  # prompt processing and the first token
    decode_token_seconds: list[float]  # each later token, as yielded

    @property
    def median_decode_ms(self) -> float:
        if not self.decode_token_seconds:
            return float("nan")
        return 1e3 * statistics.median(self.decode_token_seconds)


def greedy_generate(model: nn.Module, prompt: mx.array, max_tokens: int) -> GreedyTrace:
    """``max_tokens`` greedy tokens from mlx-lm's ``generate_step``, logits
    recorded by a logits processor that returns them unchanged."""
    from mlx_lm.generate import generate_step

    try:
        from mlx_lm.sample_utils import greedy_sampler
    except ImportError:  # mlx-lm 0.31.x: its generate_step's own default, argmax

        def greedy_sampler(logprobs: mx.array) -> mx.array:
            return mx.argmax(logprobs, axis=-1)

    step_logits: list[mx.array] = []

    def record_logits(tokens: mx.array, logits: mx.array) -> mx.array:
        step_logits.append(logits)
        return logits

    token_ids: list[int] = []
    token_seconds: list[float] = []
    started = time.perf_counter()
    for token_id, _ in generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        sampler=greedy_sampler,
        logits_processors=[record_logits],
    ):
        now = time.perf_counter()
        token_seconds.append(now - started)
        started = now
        token_ids.append(int(token_id))
    mx.eval(step_logits)
    return GreedyTrace(
        token_ids=token_ids,
        step_logits=step_logits,
        first_token_seconds=token_seconds[0] if token_seconds else float("nan"),
        decode_token_seconds=token_seconds[1:],
    )


@dataclasses.dataclass
class TraceComparison:
    steps: int
    tokens_identical: bool
    first_token_divergence: Optional[int]  # index of the first differing token
    logits_bit_identical: bool
    first_logits_divergence: Optional[int]  # index of the first differing step
    max_abs_logit_difference: float

    @property
    def identical(self) -> bool:
        return self.tokens_identical and self.logits_bit_identical


def compare_traces(reference: GreedyTrace, candidate: GreedyTrace) -> TraceComparison:
    """Token ids equal and logits equal bit for bit (dtype, shape, bits); a
    length difference counts as a divergence where the shorter one ends."""
    first_token_divergence = _first_difference(
        reference.token_ids, candidate.token_ids, lambda expected, actual: expected == actual
    )
    first_logits_divergence = _first_difference(
        reference.step_logits, candidate.step_logits, same_bits
    )
    max_abs_difference = 0.0
    for expected, actual in zip(reference.step_logits, candidate.step_logits):
        if expected.shape != actual.shape:
            max_abs_difference = float("inf")
        elif not same_bits(expected, actual):
            difference = mx.abs(expected.astype(mx.float32) - actual.astype(mx.float32))
            max_abs_difference = max(max_abs_difference, float(mx.max(difference)))
    return TraceComparison(
        steps=max(len(reference.step_logits), len(candidate.step_logits)),
        tokens_identical=first_token_divergence is None,
        first_token_divergence=first_token_divergence,
        logits_bit_identical=first_logits_divergence is None,
        first_logits_divergence=first_logits_divergence,
        max_abs_logit_difference=max_abs_difference,
    )


def _first_difference(expected_items, actual_items, same) -> Optional[int]:
    for index, (expected, actual) in enumerate(zip(expected_items, actual_items)):
        if not same(expected, actual):
            return index
    if len(expected_items) != len(actual_items):
        return min(len(expected_items), len(actual_items))
    return None


# ---- Which path each normalize_qk call took --------------------------------


@dataclasses.dataclass
class NormalizeQkCallCounts:
    """Calls of the patched ``normalize_qk``: all of them, and those that
    ran mlx-lm's own function."""

    calls: int = 0
    original: int = 0

    @property
    def folded(self) -> int:
        return self.calls - self.original


@contextlib.contextmanager
def count_normalize_qk_calls() -> Iterator[NormalizeQkCallCounts]:
    """Counts the patched ``normalize_qk``'s calls while the block runs,
    from the patch's own report (what it counted when the block ended,
    less what it had counted before)."""
    counts = NormalizeQkCallCounts()
    before = integration.report()
    try:
        yield counts
    finally:
        after = integration.report()
        counts.calls = after.normalize_qk_calls - before.normalize_qk_calls
        counts.original = after.normalize_qk_original - before.normalize_qk_original


@dataclasses.dataclass
class AttentionLayerCounts:
    """The calls of engaged attention layers that ran the package's q/k
    prework (norm + RoPE, or the q/k norm pair)."""

    package_calls: int = 0


@contextlib.contextmanager
def count_package_calls() -> Iterator[AttentionLayerCounts]:
    """Counts engaged attention layers' calls that went through the package
    while the block runs, from the patch's own report."""
    counts = AttentionLayerCounts()
    before = integration.report().calls
    try:
        yield counts
    finally:
        counts.package_calls = integration.report().calls - before


def timed_greedy_decode(
    model, prompt: mx.array, steps: int, progress: Optional[Callable[[str], None]] = None, detail: str = ""
) -> tuple[list[int], float]:
    """Prefill ``prompt``, then ``steps`` greedy decode steps through
    mlx-lm's ``generate_step``: the token ids after the prompt (``steps + 1``)
    and the median milliseconds per decode step. The first token, which
    carries the prefill, is not timed. ``progress`` hears of every token,
    the prefill's included (on a CPU a full-size step takes seconds)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import greedy_sampler

    token_ids: list[int] = []
    step_seconds: list[float] = []
    previous = time.perf_counter()
    for token_id, _ in generate_step(prompt, model, max_tokens=steps + 1, sampler=greedy_sampler):
        now = time.perf_counter()
        if token_ids:
            step_seconds.append(now - previous)
        previous = now
        token_ids.append(int(token_id))
        if progress is not None:
            progress(f"{detail} token {len(token_ids)}/{steps + 1}")
    return token_ids, 1e3 * statistics.median(step_seconds)
