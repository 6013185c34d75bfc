"""Process-wide set-up of the two extension modules, done once at import,
and the one helper that calls the cffi module.

Order matters: ``mlx.core`` is imported first so libmlx.so is loaded before
the extensions (they then reuse it: one MLX runtime per process) and MLX's
nanobind types are registered before the bridge looks them up. Then the
mlx-c error handler is installed, so no MLX error can ever reach mlx-c's
default handler (which exits), the fused modes are registered where this
build has them. The package's ``__init__`` then binds the bridge, once, to
both composites' apply functions exported by the cffi module, to their
converters for arguments that are not ``mx.array`` and to the package's
exception types (:func:`bind_bridges`).
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Callable

import mlx.core  # noqa: F401  (load libmlx.so and MLX's nanobind types first)

import mlx_dualnorm._interop as _interop
from mlx_dualnorm._errors import DualHeadNormValueError, MlxCError
from mlx_dualnorm._native import ffi, lib

__all__ = [
    "apply_compiled_dual_head_norm", "apply_compiled_dual_head_norm_rope",
    "apply_compiled_dual_head_norm_rope_with_cache", "assign_array", "bind_bridges",
    "call_native", "ffi", "lib",
]

lib.mlx_dualnorm_install_error_handler()
lib.mlx_dualnorm_set_fused_backend(lib.mlx_dualnorm_fused_backend_table())
lib.mlx_dualnorm_set_fused_rope_backend(lib.mlx_dualnorm_fused_rope_backend_table())

# The bridge's entry points, one per C apply function bound below: each
# takes the object's C address and the call's arguments as given, converts
# what is not an ``mx.array`` with the converters bound below, and returns
# the C call's outputs as a tuple, in the C call's order.
apply_compiled_dual_head_norm = _interop.apply
apply_compiled_dual_head_norm_rope = _interop.apply_rope
apply_compiled_dual_head_norm_rope_with_cache = _interop.apply_rope_with_cache
# assign_array(target, source): the object ``target`` holds ``source``'s
# array from now on, as ``target[...] = value`` makes it hold the update.
assign_array = _interop.assign

# How long the exit hook waits for threads that used the package to finish
# exiting: they have already returned to the OS, so this is their C++
# thread-local destructors' time, normally microseconds.
_THREAD_EXIT_WAIT_MS = 500


def _let_exiting_threads_finish() -> None:
    """At interpreter exit, before finalization: joined Python threads may
    still be running their C++ thread-local destructors, and those of MLX's
    Python module take the GIL, which aborts the process once finalization
    has begun. Waits (GIL released, as cffi calls do) for the threads that
    applied this package's objects. Skipped while other Python threads are
    still alive (daemon threads never exit, so waiting would only delay)."""
    current = threading.current_thread()
    if any(thread.is_alive() for thread in threading.enumerate() if thread is not current):
        return
    lib.mlx_dualnorm_await_thread_exits(_THREAD_EXIT_WAIT_MS)


atexit.register(_let_exiting_threads_finish)


def bind_bridges(
    convert_array: Callable[[object, str, str], Any],
    convert_rope_array: Callable[[object, str, str], Any],
    convert_offset: Callable[[object, str], Any],
) -> None:
    """Binds the bridge to both composites' apply functions, once, at
    import. Each ``convert_*_array(value, argument_name, operation)`` turns
    an argument of its composite that is not an ``mx.array`` into one, or
    raises TypeError labelled ``operation`` (the call's: the bridge passes
    it); ``convert_offset(value, operation)`` does that for a RoPE offset
    that is neither an ``mx.array`` nor an int within int32."""
    _interop.bind(
        _function_address("mlx_dualnorm_compiled_dual_head_norm_apply"),
        _function_address("mlx_vector_array_free"),
        convert_array,
        DualHeadNormValueError,
        MlxCError,
    )
    _interop.bind_rope(
        _function_address("mlx_dualnorm_dual_head_norm_rope_apply_with_freqs"),
        # The one holder of positions' int32 scalars, shared with the C
        # composite's KV-cache write row, and the free for its handles.
        _function_address("dualnorm_position_scalar"),
        _function_address("mlx_array_free"),
        convert_rope_array,
        convert_offset,
    )
    _interop.bind_rope_cache(
        _function_address("mlx_dualnorm_dual_head_norm_rope_apply_with_cache")
    )


def call_native(function: Callable[..., int], *arguments: Any) -> None:
    """Calls a fallible function of the C API with an error record of its
    own, which the call fills before it returns: the exception is built
    from that record, so nothing run in between (a finalizer, another
    thread) can change what it says."""
    error = ffi.new("mlx_dualnorm_error *")
    if function(*arguments, error) != lib.MLX_DUALNORM_OK:
        operation = ffi.string(error.operation).decode() if error.operation else ""
        description = ffi.string(error.description).decode(errors="replace")
        if error.status in (lib.MLX_DUALNORM_INVALID_ARGUMENT, lib.MLX_DUALNORM_CLOSED):
            raise DualHeadNormValueError(operation, description)
        raise MlxCError(operation, description)


def _function_address(name: str) -> int:
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))
