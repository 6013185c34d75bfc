"""The qwen3 attention classes: ``qwen3``, ``qwen3_moe`` and
``qwen3_next``'s gated attention.

Their q/k prework is ``rms_norm`` by ``q_norm`` / ``k_norm``, a transpose
to ``(B, H, L, D)`` and ``nn.RoPE`` at ``cache.offset``: six graph nodes
per layer. The replacements here run the same projections, cache update
and attention as the classes' ``__call__``, with the prework ONE call of
:class:`~mlx_dualnorm.CompiledDualHeadNormRope` (:mod:`.norm_rope`) and,
for a decode step, the cache write in it too (:mod:`.cache_update`). A
layer whose norms or RoPE are not what the package computes, or whose
call raises in the prework, runs the class's own ``__call__``. Each
replacement takes the mode its layer was decided in (the dispatcher passes
it after ``self``) and builds the package's objects in it.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_dualnorm.integrations.mlx_lm._shared import log_fallback_once
from mlx_dualnorm.integrations.mlx_lm import cache_update
from mlx_dualnorm.integrations.mlx_lm.cache_update import attended
from mlx_dualnorm.integrations.mlx_lm.engine import original_call
from mlx_dualnorm.integrations.mlx_lm.norm_rope import is_plain_norm_rope, layer_prework
from mlx_dualnorm.integrations.mlx_lm.registry import (
    AttentionFamily,
    register_attention_families,
)


def _layer_prework(attention, mode):
    """The layer's prework (:func:`layer_prework`), or None where reading it
    raises (the caller then runs the class's own code)."""
    try:
        return layer_prework(attention, mode)
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the full-attention norm + RoPE", error)
        return None


def _prework_and_cache_update(prework, queries, keys, values, cache):
    """:func:`prework_and_cache_update` of a qwen3-shaped layer's prework."""
    return cache_update.prework_and_cache_update(prework, queries, keys, values, cache)


def _attention_after_queries(attention, mode, x, mask, cache, head_queries, key_value_heads):
    """The rest of a layer's attention once its queries are projected: the
    key and value projections, the q/k prework with the cache update (in
    ``mode``), and attention, as (B, L, H*D); None where the call must take
    the layer's original code (_prework_and_cache_update says when)."""
    batch, length, _ = x.shape
    head_keys = attention.k_proj(x).reshape(batch, length, key_value_heads, -1)
    head_values = attention.v_proj(x).reshape(batch, length, key_value_heads, -1)
    prework = _layer_prework(attention, mode)
    if prework is None:
        return None
    prepared = _prework_and_cache_update(prework, head_queries, head_keys, head_values, cache)
    if prepared is None:
        return None
    return attended(attention, *prepared, cache, mask, batch, length)


def _qwen3_attention_call(self, mode, x, mask=None, cache=None):
    """Qwen3 / Qwen3-MoE attention with the q/k prework in one call."""
    batch, length, _ = x.shape
    head_queries = self.q_proj(x).reshape(batch, length, self.n_heads, -1)
    output = _attention_after_queries(self, mode, x, mask, cache, head_queries, self.n_kv_heads)
    if output is None:
        return original_call(self, x, mask, cache)
    return self.o_proj(output)


def _qwen3_next_attention_call(self, mode, x, mask=None, cache=None):
    """Qwen3-Next's gated full attention with the q/k prework in one call."""
    batch, length, _ = x.shape
    projected = self.q_proj(x).reshape(batch, length, self.num_attention_heads, -1)
    head_queries, gate = mx.split(projected, 2, axis=-1)
    output = _attention_after_queries(
        self, mode, x, mask, cache, head_queries, self.num_key_value_heads
    )
    if output is None:
        return original_call(self, x, mask, cache)
    return self.o_proj(output * mx.sigmoid(gate.reshape(batch, length, -1)))


def _layer_engages(attention) -> bool:
    """Whether the layer's norms and RoPE are what the package computes."""
    try:
        rope, query_norm, key_norm = attention.rope, attention.q_norm, attention.k_norm
    except AttributeError:
        return False
    return is_plain_norm_rope(rope, query_norm, key_norm)


register_attention_families(
    AttentionFamily("mlx_lm.models.qwen3", "Attention", _qwen3_attention_call, _layer_engages),
    AttentionFamily(
        "mlx_lm.models.qwen3_moe", "Attention", _qwen3_attention_call, _layer_engages
    ),
    AttentionFamily(
        "mlx_lm.models.qwen3_next", "Qwen3NextAttention", _qwen3_next_attention_call,
        _layer_engages,
    ),
)

