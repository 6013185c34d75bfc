"""mlx_dualnorm: a compiled, dual-output query/key head RMS normalization
for MLX gated-delta (Qwen3-Next / Qwen3.5 linear-attention) layers.

    >>> import mlx.core as mx
    >>> from mlx_dualnorm import CompiledDualHeadNorm
    >>> norm = CompiledDualHeadNorm(eps=1e-6)
    >>> q, k = mx.ones((1, 1, 16, 128)), mx.ones((1, 1, 16, 128))
    >>> normalized_queries, normalized_keys = norm(q, k)

bit-identical to ``mx.fast.rms_norm(q, None, 1e-6)`` and
``mx.fast.rms_norm(k, None, 1e-6)``.
"""

# Before any extension module loads: an MLX other than the one this build
# compiled against fails there with an unreadable linker error.
from mlx_dualnorm._mlx_version_guard import check_installed_mlx  # isort: skip

check_installed_mlx()

# _binding first: it loads mlx.core (and so libmlx.so) before the extension
# modules, which then reuse that very runtime.
from mlx_dualnorm import _binding, _rope_arguments, dual_head_norm  # noqa: E402  (isort: skip)
from mlx_dualnorm._composite import Mode
from mlx_dualnorm._errors import DualHeadNormValueError, MlxCError
from mlx_dualnorm.composed import composed_dual_head_norm, composed_dual_head_norm_rope
from mlx_dualnorm.dual_head_norm import (
    CompiledDualHeadNorm,
    available_modes,
    fused_outputs_in_device_pool,
)
from mlx_dualnorm.dual_head_norm_rope import CompiledDualHeadNormRope

# The one binding of the bridge, before any call can reach it.
_binding.bind_bridges(
    dual_head_norm._as_array, _rope_arguments._as_array, _rope_arguments._as_offset_array
)

__all__ = [
    "CompiledDualHeadNorm",
    "CompiledDualHeadNormRope",
    "DualHeadNormValueError",
    "MlxCError",
    "Mode",
    "available_modes",
    "composed_dual_head_norm",
    "composed_dual_head_norm_rope",
    "fused_outputs_in_device_pool",
]

__version__ = "0.1.0"
