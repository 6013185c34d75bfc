"""Shared test helpers: every comparison is bit-exact, dtypes included."""

from __future__ import annotations

import mlx.core as mx
import pytest


def assert_bit_identical(actual: mx.array, expected: mx.array) -> None:
    """Same dtype, same shape, same bits (NaN matching NaN)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if actual.size == 0:
        return  # no values (and MLX's GPU kernels cannot launch on none)
    assert mx.array_equal(actual, expected, equal_nan=True).item(), "values differ"


@pytest.fixture
def rng_key() -> mx.array:
    return mx.random.key(20261129)
