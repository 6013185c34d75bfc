"""Greedy generation through mlx-lm's own ``generate_step``, recorded and
timed; two runs compared token for token and bit for bit; what the patch's
``report()`` counted while a block ran; the patch tried before any work.
Imports mlx-lm."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from operator import eq
from typing import Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm import Mode
from mlx_dualnorm.bits import same_bits
from mlx_dualnorm.commands.shared.command import Unavailable
from mlx_dualnorm.integrations import mlx_lm as integration


def refuse_what_cannot_patch(mode: Optional[Mode]) -> None:
    """Applies the patch and takes it off: a mode this build or device cannot run, or an
    mlx-lm the integration does not support (``patch()`` names the supported releases), is
    :class:`Unavailable` before any model is built."""
    try:
        with integration.patch(mode):
            pass
    except (RuntimeError, ValueError) as error:
        raise Unavailable(str(error)) from None


@dataclasses.dataclass
class GreedyTrace:
    """Token ids, raw logits of every model step (one more than tokens:
    generate_step computes the step after the last token too), wall times."""

    token_ids: list[int]
    step_logits: list[mx.array]
    first_token_seconds: float  # prompt processing and the first token
    decode_token_seconds: list[float]  # each later token, as yielded

    @property
    def median_decode_ms(self) -> float:
        if not self.decode_token_seconds:
            return float("nan")
        return 1e3 * statistics.median(self.decode_token_seconds)


def _timed_greedy_tokens(model, prompt: mx.array, max_tokens: int,
                         **options) -> Iterator[tuple[int, float]]:
    """Greedy token ids from mlx-lm's ``generate_step``, each with the
    seconds since the one before (the first: since the start)."""
    from mlx_lm.generate import generate_step

    try:
        from mlx_lm.sample_utils import greedy_sampler
    except ImportError:  # mlx-lm 0.31.x: its generate_step's own default, argmax

        def greedy_sampler(logprobs: mx.array) -> mx.array:
            return mx.argmax(logprobs, axis=-1)

    started = time.perf_counter()
    for token_id, _ in generate_step(
        prompt, model, max_tokens=max_tokens, sampler=greedy_sampler, **options
    ):
        now = time.perf_counter()
        yield int(token_id), now - started
        started = now


def greedy_generate(model: nn.Module, prompt: mx.array, max_tokens: int) -> GreedyTrace:
    """``max_tokens`` greedy tokens, logits recorded by a logits processor."""
    step_logits: list[mx.array] = []

    def record_logits(tokens: mx.array, logits: mx.array) -> mx.array:
        step_logits.append(logits)
        return logits

    timed = list(_timed_greedy_tokens(model, prompt, max_tokens, logits_processors=[record_logits]))
    mx.eval(step_logits)
    seconds = [token_seconds for _, token_seconds in timed]
    first_token_seconds = seconds[0] if seconds else float("nan")
    return GreedyTrace([token for token, _ in timed], step_logits, first_token_seconds, seconds[1:])


def timed_greedy_decode(model, prompt: mx.array, steps: int,
                        progress: Optional[Callable[[str], None]] = None,
                        detail: str = "") -> tuple[list[int], float]:
    """The ``steps + 1`` greedy token ids after ``prompt`` and the median milliseconds
    per decode step (the first token, which carries the prefill, is not timed)."""
    token_ids: list[int] = []
    step_seconds: list[float] = []
    for token_id, seconds in _timed_greedy_tokens(model, prompt, steps + 1):
        if token_ids:
            step_seconds.append(seconds)
        token_ids.append(token_id)
        if progress is not None:
            progress(f"{detail} token {len(token_ids)}/{steps + 1}")
    return token_ids, 1e3 * statistics.median(step_seconds)


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
    first_token_divergence = _first_difference(reference.token_ids, candidate.token_ids, eq)
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
    steps = max(len(reference.step_logits), len(candidate.step_logits))
    return TraceComparison(
        steps, first_token_divergence is None, first_token_divergence,
        first_logits_divergence is None, first_logits_divergence, max_abs_difference,
    )


def _first_difference(expected_items, actual_items, same) -> Optional[int]:
    for index, (expected, actual) in enumerate(zip(expected_items, actual_items)):
        if not same(expected, actual):
            return index
    if len(expected_items) != len(actual_items):
        return min(len(expected_items), len(actual_items))
    return None


@dataclasses.dataclass
class PatchCallCounts:
    """The patched ``normalize_qk``'s calls (all, and those that ran
    mlx-lm's own), and engaged attention layers' q/k prework calls."""

    calls: int = 0
    original: int = 0
    package_calls: int = 0

    @property
    def folded(self) -> int:
        return self.calls - self.original


@contextlib.contextmanager
def count_normalize_qk_calls() -> Iterator[PatchCallCounts]:
    """The patch's counts at the block's end less those before it."""
    counts = PatchCallCounts()
    before = integration.report()
    try:
        yield counts
    finally:
        after = integration.report()
        counts.calls = after.normalize_qk_calls - before.normalize_qk_calls
        counts.original = after.normalize_qk_original - before.normalize_qk_original
        counts.package_calls = after.calls - before.calls

