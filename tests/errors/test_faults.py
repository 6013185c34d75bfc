"""Faults: what MLX throws reaches Python as an exception naming the
operation, never as a process exit; each failure's report travels with the
call that failed (error records per thread, none blanked by a finalizer
that runs in between); after any failure the same object and new ones
keep working.

Failures are provoked for real, not mocked: a raw mlx-c call with an empty
handle, a default device with no stream (MLX throws inside the graph
builder), a g++ that refuses to compile (MLX throws while evaluating the
compiled graph). What objects release on close, collection and exit is
test_lifetime.py's.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import shutil

import mlx.core as mx
import pytest
from helpers.bit_parity import CPU_BACKEND_ONLY, assert_normalized_with_eps
from helpers.isolated_process import describe, run_python
from helpers.small_heads import EPS, OTHER_EPS, assert_works, heads
from helpers.threads import run_on_threads

from mlx_dualnorm import CompiledDualHeadNorm, DualHeadNormValueError, MlxCError
from mlx_dualnorm._native import ffi, lib

# The C side's names for apply, compile and close (the facade never formats
# them itself).
APPLY_OPERATION = "dual_head_norm"
COMPILE_OPERATION = "dual_head_norm"
CLOSE_OPERATION = "dual_head_norm_close"


def new_error_record():
    """An mlx_dualnorm_error for a direct C call to fill."""
    return ffi.new("mlx_dualnorm_error *")


def reported(error) -> tuple[int, str, str]:
    return (
        error.status,
        ffi.string(error.operation).decode() if error.operation else "",
        ffi.string(error.description).decode(),
    )


# ---- the error handler ---------------------------------------------------------


def test_raw_mlx_c_failure_is_a_return_code_and_a_message(mlx_c_messages):
    assert lib.mlx_array_eval(lib.mlx_array_new()) != 0
    assert len(mlx_c_messages) == 1 and mlx_c_messages[0], mlx_c_messages


def test_the_handler_is_installed_by_importing_the_package():
    """In a fresh interpreter: the import alone installs the handler, so
    mlx-c's default handler (which prints and exits) never runs and the
    process carries on after a failing raw mlx-c call."""
    process = run_python(
        """
        import mlx_dualnorm
        from mlx_dualnorm._native import ffi, lib
        empty = lib.mlx_array_new()
        print("status", lib.mlx_array_eval(empty))
        print("still running")
        """
    )
    assert process.returncode == 0, describe(process)
    assert "status 1" in process.stdout
    assert "still running" in process.stdout
    assert "error" not in (process.stdout + process.stderr).lower(), describe(process)


def test_c_level_invalid_arguments_are_statuses_not_crashes():
    norm = CompiledDualHeadNorm(EPS)
    result = ffi.new("mlx_vector_array*", lib.mlx_vector_array_new())
    empty = lib.mlx_array_new()
    apply = lib.mlx_dualnorm_compiled_dual_head_norm_apply
    error = new_error_record()
    invalid = lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert apply(ffi.NULL, norm._native, empty, empty, empty, empty, error) == invalid
    assert apply(result, ffi.NULL, empty, empty, empty, empty, ffi.NULL) == invalid
    assert apply(result, norm._native, empty, empty, empty, empty, error) == invalid
    status, operation, description = reported(error)
    assert (status, operation) == (invalid, APPLY_OPERATION)
    assert "queries is an empty array handle" in description
    assert lib.mlx_dualnorm_compiled_dual_head_norm_close(ffi.NULL, error) == invalid
    assert reported(error)[1] == CLOSE_OPERATION
    lib.mlx_dualnorm_compiled_dual_head_norm_free(ffi.NULL)  # a no-op
    assert lib.mlx_vector_array_free(result[0]) == 0
    assert_works(norm)


def test_the_c_api_checks_the_epsilon_before_rounding_to_float32():
    """-1e-50 rounds to -0.0 in float32 and 1e39 to inf: the C API checks
    the double it is given, so both are refused (the Python constructor's
    refusals are cases of test_bad_input.py's table)."""
    created = ffi.new("mlx_dualnorm_compiled_dual_head_norm **")
    error = new_error_record()
    new = lib.mlx_dualnorm_compiled_dual_head_norm_new
    for bad_epsilon in (-1e-50, 1e39, float("nan"), -float("inf")):
        status = new(created, bad_epsilon, lib.MLX_DUALNORM_MODE_COMPILED, error)
        assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT, bad_epsilon
        assert "eps must be finite, >= 0" in reported(error)[2]


# ---- MLX failures inside the graph builder and during evaluation ------------


@contextlib.contextmanager
def a_default_device_without_a_stream():
    """A default CPU device index MLX has no stream for (the stream lookup
    inside the apply throws); the device found before comes back after."""
    previous_device = mx.default_device()
    mx.set_default_device(mx.Device(mx.cpu, 5))
    try:
        yield
    finally:
        mx.set_default_device(previous_device)


@pytest.fixture
def inputs_and_a_default_device_without_a_stream():
    """Inputs made (and evaluated) first, then a_default_device_without_a_stream."""
    inputs = heads()
    with a_default_device_without_a_stream():
        yield inputs


def test_mlx_failure_inside_the_graph_builder_is_an_mlx_c_error(
    inputs_and_a_default_device_without_a_stream,
):
    inputs = inputs_and_a_default_device_without_a_stream
    norm = CompiledDualHeadNorm(EPS)
    with pytest.raises(MlxCError) as raised:
        norm(*inputs)
    assert not isinstance(raised.value, ValueError), "an MLX failure, not a bad input"
    assert raised.value.operation == APPLY_OPERATION
    assert raised.value.description, "MLX's own message, the root cause"
    assert str(raised.value).startswith(f"[{APPLY_OPERATION}] ")
    with pytest.raises(MlxCError):
        norm(*inputs)  # fails again the same way: no half-built state
    with pytest.raises(MlxCError):
        CompiledDualHeadNorm(OTHER_EPS)(*inputs)


def test_objects_work_after_a_failure_inside_the_graph_builder():
    before = CompiledDualHeadNorm(EPS)
    assert_works(before)
    inputs = heads()
    with a_default_device_without_a_stream():
        failed = CompiledDualHeadNorm(OTHER_EPS)
        for norm in (before, failed):
            with pytest.raises(MlxCError):
                norm(*inputs)
    assert_works(before)
    assert_works(failed, OTHER_EPS)
    assert_works(CompiledDualHeadNorm(EPS))


REFUSING_GXX = """#!/bin/sh
case "$*" in *--version*) exec {real_gxx} "$@";; esac
echo "g++ refuses to compile (fault injection)" >&2
exit 1
"""


@CPU_BACKEND_ONLY
def test_mlx_failure_while_evaluating_the_compiled_graph(tmp_path):
    """A g++ that refuses to compile: the call itself succeeds (outputs are
    lazy), evaluation raises MLX's own error naming its operation, and once
    the compiler works again the same object and new ones evaluate, with
    their own epsilons. A fresh TMPDIR keeps MLX's kernel cache cold."""
    real_gxx = shutil.which("g++")
    if real_gxx is None:
        pytest.skip("needs g++ (MLX's CPU compiler)")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "g++").write_text(REFUSING_GXX.format(real_gxx=real_gxx))
    (fake_bin / "g++").chmod(0o755)
    kernel_cache = tmp_path / "tmp"
    kernel_cache.mkdir()
    process = run_python(
        f"""
        import os
        import mlx.core as mx
        from mlx_dualnorm import CompiledDualHeadNorm, MlxCError
        from helpers.small_heads import assert_works, heads

        norm = CompiledDualHeadNorm(1e-4)
        outputs = norm(*heads())
        try:
            mx.eval(outputs)
        except (RuntimeError, ValueError) as failure:
            message = str(failure)
            assert message.startswith("["), message
            print("evaluation failed:", message.splitlines()[0][:60])
        else:
            raise SystemExit("evaluation with a refusing g++ succeeded")
        del outputs
        os.environ["PATH"] = {os.path.dirname(real_gxx)!r} + os.pathsep + os.environ["PATH"]
        assert_works(norm)
        assert_works(CompiledDualHeadNorm(1e-2), 1e-2)
        print("recovered")
        """,
        env_overrides={
            "PATH": f"{fake_bin}:/usr/bin:/bin",
            "TMPDIR": str(kernel_cache),
        },
    )
    assert process.returncode == 0, describe(process)
    assert "evaluation failed: [" in process.stdout
    assert "recovered" in process.stdout


# ---- each failure's report, on its own call ---------------------------------


def test_bad_input_then_good_input_on_many_threads():
    """Thread-local error records: a failure on one thread is reported on
    that thread and never leaks into another thread's next call."""
    norm = CompiledDualHeadNorm(EPS)

    def run(seed: int) -> None:
        for _ in range(20):
            with pytest.raises(DualHeadNormValueError, match="last dimension"):
                norm(mx.ones((2, 8)), mx.ones((2, 8)), mx.ones((7,)))
            inputs = heads(seed)
            outputs = norm(*inputs)
            mx.eval(outputs)
            assert_normalized_with_eps(outputs, inputs, EPS)

    run_on_threads(*(functools.partial(run, seed) for seed in range(4)))


class CyclicGarbage:
    """An unreachable cycle holding an open norm: only the cyclic garbage
    collector frees it, running its finalizer (close, then free) at
    whatever allocation triggers a collection."""

    def __init__(self) -> None:
        self.norm = CompiledDualHeadNorm(1e-5)
        self.cycle = self


def test_a_finalizer_between_failure_and_raise_cannot_blank_the_error():
    """With a collection at almost every allocation, finalizers of cyclic
    garbage norms run between any two bytecodes. Every failing call must
    still raise its own error, whole."""
    norm = CompiledDualHeadNorm(1e-6)
    short_weight = mx.ones((3,))
    previous_threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for attempt in range(3000):
            CyclicGarbage()
            with pytest.raises(DualHeadNormValueError) as raised:
                norm(mx.ones((2, 8)), mx.ones((2, 8)), short_weight)
            assert raised.value.operation == APPLY_OPERATION, attempt
            assert "has 3 elements" in raised.value.description, attempt
            CyclicGarbage()
            with pytest.raises(DualHeadNormValueError) as raised:
                CompiledDualHeadNorm(-1.0)
            assert raised.value.operation == COMPILE_OPERATION, attempt
    finally:
        gc.set_threshold(*previous_threshold)
        gc.collect()
