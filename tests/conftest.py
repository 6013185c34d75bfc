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


@pytest.fixture
def mlx_c_messages():
    """The messages mlx-c hands its error handler during the test, in order,
    caught by a handler of the test's own; the package's handler is put back
    afterwards. For tests of raw mlx-c calls, whose messages the package's
    handler keeps only for its own calls."""
    from mlx_dualnorm._native import ffi, lib

    messages: list[str] = []

    def keep(message, data) -> None:
        messages.append(ffi.string(message).decode(errors="replace"))

    handler = ffi.callback("mlx_error_handler_func", keep)
    lib.mlx_set_error_handler(handler, ffi.NULL, ffi.NULL)
    try:
        yield messages
    finally:
        lib.mlx_dualnorm_install_error_handler()
