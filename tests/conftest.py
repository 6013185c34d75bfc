"""Shared test helpers: every comparison is bit-exact, dtypes included."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_dualnorm._bits import count_bit_differences


def assert_bit_identical(actual: mx.array, expected: mx.array) -> None:
    """Same dtype, same shape, same bits in every element (signed zeros and
    NaN payloads included): the package's one comparison rule."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    differing = count_bit_differences(actual, expected)
    assert differing == 0, f"{differing} of {actual.size} elements differ in bits"


@pytest.fixture
def rng_key() -> mx.array:
    return mx.random.key(20261129)
