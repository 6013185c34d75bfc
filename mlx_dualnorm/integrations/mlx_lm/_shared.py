"""What the integration's layer shapes share: the constants of what they
take, the marker on their replacements, the bounded cache of built objects
and the once-per-reason log of calls that run mlx-lm's own code."""

from __future__ import annotations

import logging
from typing import Callable

LOGGER = logging.getLogger("mlx_dualnorm.integrations.mlx_lm")

# The releases proven (docs/mlx-lm.md's table): mlx-lm gained
# gated_delta.normalize_qk in 0.32.0 (before, its gated-delta layers
# normalize inline, so only attention layers are patched).
SUPPORTED_MLX_LM = (
    "mlx-lm 0.32.0 to 0.32.2 (the mlx-lm extra installs 0.32.2), and 0.30.7 and 0.31.3 "
    "for attention layers only"
)

# Marks our replacements, so a reloaded copy of this package still knows them.
REPLACEMENT_MARKER = "_mlx_dualnorm_replacement"

PLAIN_SCALAR_TYPES = (float, int)
# The most entries each of the integration's caches of built objects holds
# (the gated-delta folds, the norm + RoPE objects, the head norms): their
# keys are model constants (a few per model); past this, new keys run the
# original instead of growing the cache.
MAX_CACHED_OBJECTS = 256


def is_mlx_function(name: str, function: object) -> bool:
    """Whether ``function`` is MLX's own ``mx.fast.NAME`` (a nanobind
    function of that name in ``mlx.core.fast``)."""
    return (
        type(function).__name__ == "nb_func"
        and getattr(function, "__module__", None) == "mlx.core.fast"
        and getattr(function, "__name__", None) == name
    )


def cached_or_built(cache: dict, lock, key, build: Callable[[], object], when_full):
    """``cache[key]``, built once under ``lock`` on a miss, or ``when_full``
    (nothing built) once the cache holds MAX_CACHED_OBJECTS entries. A hit
    takes no lock: it runs for every layer of every decode step."""
    value = cache.get(key)
    if value is not None:
        return value
    with lock:
        value = cache.get(key)
        if value is None:
            if len(cache) >= MAX_CACHED_OBJECTS:
                return when_full
            value = build()
            cache[key] = value
        return value



_logged_fallbacks: set = set()


def log_fallback_once(
    place: str, reason: object, outcome: str = "runs mlx-lm's own code"
) -> None:
    """Logs at debug level, once per ``(place, reason)``, that ``place``
    ran mlx-lm's own code (or another ``outcome``) and why. ``reason`` is a
    sentence, or the exception caught, logged once per exception type."""
    key = (place, type(reason) if isinstance(reason, BaseException) else reason)
    if key in _logged_fallbacks:
        return
    _logged_fallbacks.add(key)
    if isinstance(reason, BaseException):
        reason = f"{type(reason).__name__}: {reason}"
    LOGGER.debug("%s %s: %s", place, outcome, reason)
