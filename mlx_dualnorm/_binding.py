"""Process-wide set-up of the two extension modules, done once at import.

Order matters: ``mlx.core`` is imported first so libmlx.so is loaded before
the extensions (they then reuse it: one MLX runtime per process) and MLX's
nanobind types are registered before the bridge looks them up. Then the
mlx-c error handler is installed, so no MLX error can ever reach the
subset's default handler, and the bridge is bound to the composite's apply
function exported by the cffi module.
"""

from __future__ import annotations

import mlx.core  # noqa: F401  (load libmlx.so and MLX's nanobind types first)

import mlx_dualnorm._interop as _interop
from mlx_dualnorm._native import ffi, lib

lib.mlx_dualnorm_install_error_handler()


def _function_address(name: str) -> int:
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))


_interop.bind(
    _function_address("mlx_dualnorm_apply_compiled_dual_head_norm"),
    _function_address("mlx_vector_array_free"),
)

apply_compiled_dual_head_norm = _interop.apply

__all__ = ["apply_compiled_dual_head_norm", "ffi", "lib"]
