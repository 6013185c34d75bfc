"""Types of the nanobind bridge (csrc/interop/array_bridge.cpp)."""

from typing import Optional

import mlx.core as mx

def bind(apply_function_address: int, free_vector_function_address: int) -> None: ...
def apply(
    dual_head_norm_address: int,
    queries: object,
    keys: object,
    query_weight: object = None,
    key_weight: object = None,
) -> Optional[tuple[mx.array, ...]]: ...
