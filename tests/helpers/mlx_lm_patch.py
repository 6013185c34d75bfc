"""Checks of the mlx-lm patch that more than one test module makes: loss
and gradients patched against unpatched (and the one-token step they are
compared on), calls counted on classes whose code the patch must prove,
and the integration's cached proofs dropped."""

from __future__ import annotations

import collections

import mlx.core as mx
import mlx.nn as nn
import pytest

from helpers.bit_parity import assert_bit_identical
from mlx_dualnorm.bits import count_bit_differences

# Unpatched repeats that decide whether mlx-lm's own step reproduces a
# gradient the patched step gave other bits to.
GRADIENT_REPEATS = 4


def assert_patched_loss_and_gradients_match(step, loss_of=lambda outputs: outputs):
    """``step()`` (a ``value_and_grad`` call: the loss, or outputs that
    ``loss_of`` reads it from, and the gradients) unpatched, then patched:
    the loss and every gradient the same bits; returns the unpatched
    gradients.

    A comparison means something only where mlx-lm's own step is
    reproducible. On MLX's CUDA backend some gradients are not (the
    embedding's scatter-add, MoE experts' gathered products): two unpatched
    steps may differ, or agree by chance and differ on the third. So a
    gradient the patched step gave other bits is left out only where one of
    up to :data:`GRADIENT_REPEATS` more unpatched steps differs from the
    first too; every other gradient is compared, and the test skips where
    one the package's call computes or feeds (a norm's, a query or key
    projection's) is left out."""
    from mlx.utils import tree_flatten

    from mlx_dualnorm.integrations import mlx_lm as integration

    outputs, gradients = step()
    with integration.patch():
        patched_outputs, patched_gradients = step()
    assert_bit_identical(loss_of(patched_outputs), loss_of(outputs))
    flat_gradients = dict(tree_flatten(gradients))
    flat_patched_gradients = dict(tree_flatten(patched_gradients))
    assert flat_patched_gradients.keys() == flat_gradients.keys()
    differing = {
        path for path, gradient in flat_patched_gradients.items()
        if count_bit_differences(gradient, flat_gradients[path])
    }
    unreproducible: set = set()
    for _ in range(GRADIENT_REPEATS if differing else 0):
        repeated = dict(tree_flatten(step()[1]))
        unreproducible |= {
            path for path in differing
            if count_bit_differences(repeated[path], flat_gradients[path])
        }
        if unreproducible == differing:
            break
    if any(carries_the_prework_cotangent(path) for path in unreproducible):
        pytest.skip("unpatched steps give this model's q/k norm or projection gradients "
                    "other bits here")
    for path, gradient in flat_patched_gradients.items():
        if path not in unreproducible:
            assert_bit_identical(gradient, flat_gradients[path], path)
    return gradients


def one_token_step_loss(model: nn.Module, with_cache: bool) -> mx.array:
    """The loss of a one-token step of two sequences (tokens 5 and 9,
    targets 17 and 3), alone or, ``with_cache``, after an 8-token prefill of
    each into mlx-lm's caches: the step whose gradients the one-token-step
    parity tests compare."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = None
    if with_cache:
        cache = make_prompt_cache(model)
        model(mx.array([[(7 * column + 3 + row) % 512 for column in range(8)]
                        for row in range(2)]), cache=cache)
    logits = model(mx.array([[5], [9]]), cache=cache)
    return nn.losses.cross_entropy(logits.astype(mx.float32), mx.array([[17], [3]])).mean()


# The projections whose weight gradients are made from the cotangents the
# package's call gives its queries and keys.
_QUERY_KEY_PROJECTIONS = ("q_proj", "k_proj", "qkv_proj")


def carries_the_prework_cotangent(path: str) -> bool:
    """Whether a flattened parameter path names a weight whose gradient the
    package's call computes or feeds: a norm module's, or a query or key
    projection's."""
    parts = path.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and (
        "norm" in parts[-2] or parts[-2] in _QUERY_KEY_PROJECTIONS
    )


# ---- Counting calls of classes whose code the patch must prove -------------------
#
# The patch engages a layer only where its norms' and RoPE's __call__ are the
# recorded code, so a test that wraps those to count calls must also record
# the wrapper, or every layer is (rightly) left to mlx-lm. The wrapper is a
# module function here (a nested one has no fingerprint) that counts per
# module and calls the class's own __call__.
_COUNTED_CALLS: collections.Counter = collections.Counter()
_UNCOUNTED_CALLS: dict = {}


def counted_call(self, *arguments, **keywords):
    _COUNTED_CALLS[id(self)] += 1
    own_call = next(_UNCOUNTED_CALLS[cls] for cls in type(self).__mro__ if cls in _UNCOUNTED_CALLS)
    return own_call(self, *arguments, **keywords)


def forget_proofs() -> None:
    """Drops the integration's cached proofs (a test changed recorded code
    or a piece): each piece is fingerprinted again at its next use."""
    from mlx_dualnorm.integrations.mlx_lm import cache_update, registry

    registry.forget_verdicts()
    cache_update.forget_cache_proofs()


def count_module_calls(monkeypatch, classes) -> collections.Counter:
    """Counts, per module (by id), calls of each class's own ``__call__``
    for the rest of the test, with the counting wrapper recorded as proven
    code of each class (what the patch's own path does not call stays 0)."""
    from mlx_dualnorm.integrations.mlx_lm import registry
    from mlx_dualnorm.integrations.mlx_lm.fingerprints import function_fingerprint

    fingerprint = function_fingerprint(counted_call)
    assert fingerprint is not None
    _COUNTED_CALLS.clear()
    for counted_class in classes:
        if vars(counted_class).get("__call__") is counted_call:
            continue
        _UNCOUNTED_CALLS[counted_class] = counted_class.__call__
        monkeypatch.setattr(counted_class, "__call__", counted_call)
        piece = registry.piece_name(counted_class, "__call__")
        monkeypatch.setitem(
            registry.RECORDED_CODE, piece, registry.RECORDED_CODE.get(piece, frozenset()) | {fingerprint}
        )
    forget_proofs()
    return _COUNTED_CALLS


def count_applied_calls(monkeypatch, module, name: str, counts: dict, key: str) -> None:
    """Replaces ``module.name`` for the test with a wrapper that adds 1 to
    ``counts[key]`` each time the function returns something other than
    None (how the integration's entry points say they applied)."""
    function = getattr(module, name)

    def counting(*arguments):
        result = function(*arguments)
        counts[key] += result is not None
        return result

    monkeypatch.setattr(module, name, counting)
