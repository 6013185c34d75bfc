"""Small query and key heads and the check that an object still computes
its own epsilon's bits: what the fault and lifetime tests (and the fresh
interpreters they start) call after every failure and release."""

from __future__ import annotations

import mlx.core as mx

from helpers.bit_parity import assert_normalized_with_eps
from mlx_dualnorm import CompiledDualHeadNorm

EPS = 1e-4
OTHER_EPS = 1e-2


def heads(seed: int = 0) -> tuple:
    """(queries, keys, None, None): two small evaluated head sets."""
    queries_key, keys_key = mx.random.split(mx.random.key(seed))
    queries = mx.random.normal((2, 4, 32), key=queries_key) * 1e-3
    keys = mx.random.normal((2, 2, 32), key=keys_key) * 1e-3
    mx.eval(queries, keys)
    return (queries, keys, None, None)


def assert_works(norm: CompiledDualHeadNorm, eps: float = EPS) -> None:
    """``norm`` gives the composed path's bits for ``eps``, and not those of
    the other epsilon here."""
    inputs = heads(1)
    outputs = norm(*inputs)
    mx.eval(outputs)
    assert_normalized_with_eps(outputs, inputs, eps, (OTHER_EPS if eps != OTHER_EPS else EPS,))
