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


def assert_transforms_agree(transform: str, actual, expected, primals, vmap_arguments) -> None:
    """``actual`` and ``expected``, functions of (queries, keys,
    query_weight, key_weight) returning a list of arrays, give the same bits
    under ``transform``: "vjp" and "jvp" at ``primals`` with the same seeded
    cotangents or tangents, or "vmap" over ``vmap_arguments`` (queries and
    keys batched on axis 0, the weights shared)."""

    def transformed(function):
        if transform == "vjp":
            cotangents = [
                mx.random.normal(output.shape, key=mx.random.key(20 + index))
                for index, output in enumerate(expected(*primals))
            ]
            return mx.vjp(function, primals, cotangents)[1]
        if transform == "jvp":
            tangents = [
                mx.random.normal(primal.shape, key=mx.random.key(30 + index))
                for index, primal in enumerate(primals)
            ]
            return mx.jvp(function, primals, tangents)[1]
        return mx.vmap(function, in_axes=(0, 0, None, None))(*vmap_arguments)

    expected_outputs = transformed(expected)
    actual_outputs = transformed(actual)
    assert len(actual_outputs) == len(expected_outputs)
    for a, e in zip(actual_outputs, expected_outputs):
        assert_bit_identical(a, e)


@pytest.fixture
def unpatched_mlx_lm():
    """mlx-lm as it ships before and after the test: the package's patch
    removed either side (modules of mlx-lm tests use it for every test)."""
    from mlx_dualnorm.integrations import mlx_lm as integration

    integration.unpatch()
    yield
    integration.unpatch()


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
