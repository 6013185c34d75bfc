"""The q/k prework with the KV-cache update, and attention over what it
returns: what every full-attention shape runs after its projections.

For a decode step of one of mlx-lm's caches that the one call may write
(:data:`.registry.WRITTEN_CACHES`, every method it restates proven), the
norm + RoPE and both cache writes are ONE call
(:meth:`~mlx_dualnorm.CompiledDualHeadNormRope.apply_with_cache`), and the
cache's own bookkeeping is done here line for line, into the array objects
the cache holds. Every other step (another cache, a step that grows, trims
or reorders the buffers) takes the norm + RoPE call, then the cache's own
``update_and_fetch``.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import NamedTuple, Optional

import mlx.core as mx

from mlx_dualnorm._binding import assign_array
# norm_rope's functions are read as its attributes at each call, so a
# wrapper set there (a tool counting calls) sees every call.
from mlx_dualnorm.integrations.mlx_lm import norm_rope, registry
from mlx_dualnorm.integrations.mlx_lm.prework_log import NORM_ROPE, ROPE_ONLY, note_prework
from mlx_dualnorm.integrations.mlx_lm.norm_rope import LayerPrework
from mlx_dualnorm.integrations.mlx_lm.state import STATE
from mlx_dualnorm.integrations.mlx_lm._shared import log_fallback_once


_ARRAY = mx.array
_PLAIN, _BATCHED = registry.PLAIN_CACHE, registry.BATCHED_CACHE
_ROTATING, _BATCHED_ROTATING = registry.ROTATING_CACHE, registry.BATCHED_ROTATING_CACHE

class _CacheClass(NamedTuple):
    """What is known of one cache class: its kind where every method a
    step of the one call restates resolves to recorded code (None: the
    class keeps its own update); ``methods``: ``(name, function)`` as the
    class resolved them when proven, tested by identity at every call (a
    method changed since is proven again); ``names``: the method names,
    which an object of the class must not hold itself."""

    kind: Optional[str]
    methods: tuple
    names: frozenset


# class -> _CacheClass, filled once per class, and again where one of its
# methods is no longer the function proven (a monkeypatch).
_cache_classes: dict = {}
_cache_classes_lock = threading.Lock()


def _cache_kind(cache) -> Optional[str]:
    """The bookkeeping kind of ``cache`` where the one call may write it
    (each method it restates resolving to recorded code, and none of them
    set on the object itself), else None. A few identity tests and a set
    test per call."""
    cache_class = type(cache)
    known = _cache_classes.get(cache_class)
    if known is None:
        known = _prove_cache_class(cache_class)
    else:
        for name, function in known.methods:
            if getattr(cache_class, name, None) is not function:
                known = _prove_cache_class(cache_class)
                break
    kind = known.kind
    if kind is not None and not known.names.isdisjoint(getattr(cache, "__dict__", ())):
        return None  # the object's own method runs for it
    return kind


def forget_cache_proofs() -> None:
    """Drops every cache class's proof: each is proven again at its next use."""
    with _cache_classes_lock:
        _cache_classes.clear()


def _prove_cache_class(cache_class: type) -> _CacheClass:
    """Recognises ``cache_class`` by the code its methods resolve to (not
    by its name): a kind of :data:`.registry.WRITTEN_CACHES`, or None."""
    with _cache_classes_lock:
        found = registry.cache_kind_of(cache_class)
        names = ("update_and_fetch",) if found is None else found[1]
        known = _CacheClass(
            None if found is None else found[0],
            tuple((name, getattr(cache_class, name, None)) for name in names),
            frozenset(names),
        )
        _cache_classes[cache_class] = known
        return known


class _CacheStep(NamedTuple):
    """Where a step's rows go in a cache's buffers (axis 2) and what the
    class's update returns once they are written: the whole buffers, or
    rows ``[0, row + L)``."""

    row: int
    returns_whole_buffers: bool


def _cache_step(kind: str, cache, length: int) -> Optional[_CacheStep]:
    """The step the class's ``update_and_fetch`` would take for ``length``
    new rows, where it writes them into its buffers as they are; None where
    it would grow, trim, concatenate or reorder them (the class then runs
    its own update)."""
    buffer = cache.keys
    if buffer.__class__ is not _ARRAY or cache.values.__class__ is not _ARRAY:
        return None  # not yet allocated, or buffers the class's own update must handle
    capacity = buffer.shape[2]
    if kind in (_ROTATING, _BATCHED_ROTATING):
        # RotatingKVCache._update_in_place (one row) without growing or
        # trimming: the row goes at _idx, at `keep` once _idx reaches
        # max_size; keys_and_values then gives rows [0, rows written) while
        # the buffer is not yet full (no rotation has happened), else all.
        # BatchRotatingKVCache's is the same with `keep` 0 and its written
        # rows in `_offset` (`offset` holds each sequence's position), once
        # finalize() has run (`_lengths` None; else the class raises).
        batched = kind == _BATCHED_ROTATING
        if batched and cache._lengths is not None:
            return None
        written = cache._offset if batched else cache.offset
        grows = written >= capacity and capacity < cache.max_size
        if length != 1 or grows or capacity > cache.max_size:
            return None
        keep = 0 if batched else cache.keep
        row = keep if cache._idx == cache.max_size else cache._idx
        end = written + length
        if row < 0 or row + length > capacity or (end < capacity and row + length != end):
            return None
        return _CacheStep(row, returns_whole_buffers=end >= capacity)
    row = cache._idx if kind == _BATCHED else cache.offset
    if row < 0 or row + length > capacity:
        return None
    # KVCache.keys_and_values: the whole buffer once the rows reach its end.
    return _CacheStep(row, returns_whole_buffers=kind == _PLAIN and row + length >= capacity)


def _advance(kind: str, cache, step: _CacheStep, length: int) -> None:
    """The class's bookkeeping after its update wrote ``step``'s rows (the
    written buffers already assigned to the cache's arrays)."""
    end = step.row + length
    if kind == _PLAIN:
        cache.offset = end
        return
    if kind == _BATCHED_ROTATING:
        if cache._idx == cache.max_size:
            cache.rotated = True
        if cache.rotated:
            cache.left_padding -= length
        cache._offset += length
    cache.offset = cache.offset + length  # per-sequence offsets in the batched classes
    cache._idx = end
    if kind == _BATCHED_ROTATING:
        # As the class does: its padding and offsets evaluated with its keys.
        cache.keys = mx.depends(cache.keys, (cache.left_padding, cache.offset))


def _written_in_one_call(layer_call, prework: LayerPrework, queries, keys, values, cache):
    """What ``update_and_fetch`` of a ``KVCache``, ``BatchKVCache``,
    ``RotatingKVCache`` or ``BatchRotatingKVCache`` (exact types) returns,
    with the norm + RoPE and both buffer writes in ONE call
    (:meth:`CompiledDualHeadNormRope.apply_with_cache`), the cache left as
    the class leaves it: ``(rotated queries, keys, values)``. None where the
    call does not apply (another cache, a step that grows, trims or
    reorders the buffers); the caller then takes the two-step path, whose
    ``update_and_fetch`` does that as the class does."""
    kind = _cache_kind(cache)
    if kind is None:
        return None
    length = keys.shape[1]
    step = _cache_step(kind, cache, length)
    if step is None:
        return None
    try:
        table = {}
        if type(layer_call) is functools.partial:  # a scaled RoPE: the object and its table
            layer_call, table = layer_call.func, layer_call.keywords
        rotated_queries, written_keys, written_values, fetched_keys, fetched_values = (
            layer_call.apply_with_cache(
                queries, keys, values, prework.query_weight, prework.key_weight,
                key_cache=cache.keys, value_cache=cache.values, offset=cache.offset,
                write_offset=step.row, fetch=True, **table,
            )
        )
    except Exception as error:  # the cache is untouched: the two-step path runs instead
        log_fallback_once("the full-attention norm + RoPE with the cache write", error)
        return None
    # The class's own bookkeeping. Its item assignment updates the array
    # objects the cache holds: so does this (every holder of them sees the
    # written rows), and the old buffers are then read only by the call's
    # node, so MLX writes into their memory.
    assign_array(cache.keys, written_keys)
    assign_array(cache.values, written_values)
    _advance(kind, cache, step, length)
    if step.returns_whole_buffers:
        return rotated_queries, cache.keys, cache.values
    # Rows [0, row + L) of both buffers, as the class slices them (made by
    # the same call: no indexing left to do here).
    return rotated_queries, fetched_keys, fetched_values


def prework_and_cache_update(prework: LayerPrework, queries, keys, values, cache):
    """The q/k prework and the cache update of a full-attention layer, for
    queries ``(B, L, Hq, D)``, keys ``(B, L, Hk, D)`` and values
    ``(B, L, Hk, Dv)`` as the projections give them: ``(queries, keys,
    values)`` ready for attention, ``(B, H, L', D)``, or None where the
    layer's norms or RoPE are not what the package computes (the caller
    then runs the class's own __call__). One call of the package for a
    step of one of the caches :func:`_written_in_one_call` writes within
    its buffers; otherwise the norm + RoPE call, then
    ``cache.update_and_fetch``. For any family whose attention is
    ``rms_norm`` + RoPE of q and k before the cache: the norms of ``(B, L,
    H, D)`` heads and of their ``(B, H, L, D)`` transposes are the same
    rows, normalized alike."""
    try:
        layer_call = norm_rope.norm_rope_for(
            prework.rope, prework.query_norm, prework.key_norm, prework.mode
        )
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the full-attention norm + RoPE", error)
        return None
    if layer_call is None:
        return None
    written = _written_in_one_call(layer_call, prework, queries, keys, values, cache)
    if written is not None:
        if STATE.prework_log is not None:  # a tool is recording
            note_prework(NORM_ROPE if prework.query_norm is not None else ROPE_ONLY)
        return written
    rotated = norm_rope.rotated_queries_and_keys(layer_call, prework, queries, keys, cache)
    if rotated is None:
        return None
    if STATE.prework_log is not None:  # a tool is recording
        note_prework(NORM_ROPE if prework.query_norm is not None else ROPE_ONLY)
    rotated_queries, rotated_keys = rotated
    return with_cache_update(rotated_queries, rotated_keys, values, cache)


def with_cache_update(rotated_queries, rotated_keys, values, cache):
    """``(queries, keys, values)`` ready for attention from rotated ``(B, H,
    L, D)`` queries and keys and ``(B, L, H, D)`` values: the values
    transposed, and keys and values through the cache's own
    ``update_and_fetch`` where there is a cache."""
    values = values.transpose(0, 2, 1, 3)
    if cache is not None:
        rotated_keys, values = cache.update_and_fetch(rotated_keys, values)
    return rotated_queries, rotated_keys, values


def attention_output(attention, queries, keys, values, cache, mask, batch, length):
    """The cache update and attention of mlx-lm's layers, as (B, L, H*D)."""
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    return attended(attention, queries, keys, values, cache, mask, batch, length)


def module_attention(attention):
    """The ``scaled_dot_product_attention`` of the layer's model module,
    looked up at each call as the module's code looks up its own name."""
    return sys.modules[type(attention).__module__].scaled_dot_product_attention


def attended(attention, queries, keys, values, cache, mask, batch, length):
    """Attention over keys and values already fetched, as (B, L, H*D)."""
    attended = module_attention(attention)(
        queries, keys, values, cache=cache, scale=attention.scale, mask=mask
    )
    return attended.transpose(0, 2, 1, 3).reshape(batch, length, -1)

