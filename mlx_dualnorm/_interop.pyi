"""Types of the nanobind bridge (csrc/interop/array_bridge.cpp)."""

from typing import Callable

import mlx.core as mx

def bind(
    apply_function_address: int,
    free_vector_function_address: int,
    convert_array: Callable[[object, str, str], mx.array],
    value_error_type: type,
    mlx_error_type: type,
) -> None: ...
def apply(
    dual_head_norm_address: int,
    queries: object,
    keys: object,
    query_weight: object = None,
    key_weight: object = None,
) -> tuple[mx.array, ...]: ...
def bind_rope(
    apply_function_address: int,
    position_scalar_function_address: int,
    free_array_function_address: int,
    convert_array: Callable[[object, str, str], mx.array],
    convert_offset: Callable[[object, str], mx.array],
) -> None: ...
def apply_rope(
    norm_rope_address: int,
    queries: object,
    keys: object,
    query_weight: object,
    key_weight: object,
    offset: object,
    freqs: object = None,
) -> tuple[mx.array, ...]: ...
def assign(target: mx.array, source: mx.array) -> None: ...
def bind_rope_cache(apply_with_cache_function_address: int) -> None: ...
def apply_rope_with_cache(
    norm_rope_address: int, queries: object, keys: object, values: object,
    query_weight: object, key_weight: object, offset: object, freqs: object,
    key_cache: object, value_cache: object, write_offset: object, fetch: bool = False,
) -> tuple[mx.array, ...]: ...
