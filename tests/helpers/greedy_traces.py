"""The mlx-lm tests' one comparison of two greedy generations, and greedy
logits over caches a test holds."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from helpers.bit_parity import assert_bit_identical
from mlx_dualnorm.commands.shared.generation import GreedyTrace, compare_traces


def assert_traces_bit_identical(
    reference: GreedyTrace, patched: GreedyTrace, steps: Optional[int] = None, context: str = ""
) -> None:
    """``patched`` generated what ``reference`` did: the same token ids and,
    at every model step, logits of the same dtype, shape and bits (each step
    compared with its own failure message); with ``steps``, that many model
    steps each."""
    comparison = compare_traces(reference, patched)
    assert patched.token_ids == reference.token_ids, (context, comparison)
    assert comparison.tokens_identical and comparison.logits_bit_identical, (context, comparison)
    assert len(patched.step_logits) == len(reference.step_logits), (context, comparison)
    if steps is not None:
        assert len(patched.step_logits) == steps, (context, comparison)
    for step, (actual, expected) in enumerate(zip(patched.step_logits, reference.step_logits)):
        assert_bit_identical(actual, expected, f"{context} step {step}".strip())


def greedy_logits(model, rows: mx.array, caches, steps: int) -> list[mx.array]:
    """The last position's logits of ``model`` over ``rows`` (B, L), then
    of ``steps`` greedy tokens, each step through ``caches`` (ones the
    test made, to change or inspect them), evaluated."""
    logits = model(rows, cache=caches)[:, -1, :]
    history = [logits]
    for _ in range(steps):
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=caches)[:, -1, :]
        history.append(logits)
    mx.eval(history)
    return history

