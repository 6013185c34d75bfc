"""Attention layers that normalize q and k per head before the transpose,
outside the qwen3 shape.

``gemma3n`` and ``gemma4_text`` normalize q, k (and v, with a weightless
``v_norm``) on ``(B, L, H, D)`` heads, then transpose and rotate at the
``offset`` the model passes or computes. Their KV-shared layers take keys
and values from another layer and normalize q only: those layers run
mlx-lm's own ``__call__`` (decided once per layer), and so does any call
that hands a layer shared keys and values. ``gear`` (norms of weight
``(1.0 + w)`` in the input dtype) does the same in its attention layers,
and normalizes q and k before its convolutions in its conv mixers.

In gemma3n's and gemma4_text's layers whose RoPE the qwen3 layers cover
(``nn.RoPE``, the scaled RoPEs of ``rope_utils`` such as gemma4's
``ProportionalRoPE``) the q/k norms, the transpose and the RoPE are ONE
call of the qwen3 layers' :class:`~mlx_dualnorm.CompiledDualHeadNormRope`
(the same primitives in the same order), and with the caches
:func:`.cache_update.prework_and_cache_update` writes, the cache write
too: the values, through the layer's own ``v_norm`` first, are written as
given; elsewhere the replacements make the q/k norm calls one
:func:`~.head_norms.normalized_pair` call on the same arrays and keep every
other op, RoPE included, as mlx-lm writes it.
"""

from __future__ import annotations

import sys

import mlx.core as mx

from mlx_dualnorm.integrations.mlx_lm import cache_update, head_norms
from mlx_dualnorm.integrations.mlx_lm.cache_update import (
    attended,
    attention_output,
)
from mlx_dualnorm.integrations.mlx_lm.engine import original_call
from mlx_dualnorm.integrations.mlx_lm.registry import (
    AttentionFamily,
    register_attention_families,
)
from mlx_dualnorm.integrations.mlx_lm.norm_after_transpose import REFUSAL


def _at_cache_offset(offset, cache) -> bool:
    """Whether rotating at ``offset`` is rotating at the cache's offset (0
    without a cache), known without evaluating anything."""
    if cache is None:
        return type(offset) is int and offset == 0
    return offset is cache.offset or (
        type(offset) is int and type(cache.offset) is int and offset == cache.offset
    )


def _prepared_heads(attention, mode, queries, keys, values, cache, offset, at_cache_offset):
    """Queries, keys and values ready for attention, ``(B, H, L', D)``, from
    ``(B, L, H, D)`` heads (``values`` already through the layer's
    ``v_norm``): q and k normalized and rotated at ``offset``, the cache
    updated. Where ``offset`` is known to be the cache's own, the norms,
    the RoPE and the cache write are ONE norm + RoPE call, as in qwen3;
    otherwise, or where that call does not apply, the norm + RoPE of
    :func:`~.head_norms.normalized_rotated_heads` and the cache's own
    update. The package's objects are built in ``mode``. None where neither
    computes the layer."""
    if at_cache_offset:
        prework = head_norms.norm_rope_prework(
            "the per-head norm + RoPE with the cache write",
            attention.rope, attention.q_norm, attention.k_norm, queries, keys, mode,
        )
        if prework is not None:
            prepared = cache_update.prework_and_cache_update(prework, queries, keys, values, cache)
            if prepared is not None:
                return prepared
    rotated = head_norms.normalized_rotated_heads(
        queries, keys, attention.q_norm, attention.k_norm, attention.rope, offset, mode
    )
    if rotated is None:
        return None
    return cache_update.with_cache_update(*rotated, values, cache)


def _gemma3n_attention_call(self, mode, x, mask=None, cache=None, offset=0):
    if self.is_kv_shared_layer and cache is not None:  # keys and values from another layer
        return original_call(self, x, mask, cache, offset)
    B, L, _ = x.shape
    queries = self.q_proj(x).reshape(B, L, -1, self.head_dim)
    keys = self.k_proj(x).reshape(B, L, -1, self.head_dim)
    values = self.v_norm(self.v_proj(x).reshape(B, L, -1, self.head_dim))
    # The model passes the first cache's offset to every layer.
    prepared = _prepared_heads(
        self, mode, queries, keys, values, cache, offset, _at_cache_offset(offset, cache)
    )
    if prepared is None:
        return original_call(self, x, mask, cache, offset)
    return self.o_proj(attended(self, *prepared, cache, mask, B, L))


def _gemma4_text_attention_call(
    self, mode, x, mask=None, cache=None, shared_kv=None, offset=None
):
    if shared_kv is not None or not self.has_kv:  # keys and values from another layer
        return original_call(self, x, mask, cache, shared_kv, offset)
    B, L, _ = x.shape
    queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
    keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
    values = keys
    if not self.use_k_eq_v:
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
    # mlx-lm rotates at mx.array(cache.offset) and returns that array; the
    # one call rotates at cache.offset itself, the same int32 position.
    rope_offset = mx.array(cache.offset) if cache is not None else 0
    prepared = _prepared_heads(
        self, mode, queries, keys, self.v_norm(values), cache, rope_offset, at_cache_offset=True
    )
    if prepared is None:
        return original_call(self, x, mask, cache, shared_kv, offset)
    output = attended(self, *prepared, cache, mask, B, L)
    return self.o_proj(output), prepared[1:], rope_offset


def _gear_attention_call(self, mode, x, mask=None, cache=None):
    B, L, _ = x.shape
    queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
    keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
    normalized = head_norms.normalized_pair(queries, keys, self.q_norm, self.k_norm, mode)
    if normalized is None:
        return original_call(self, x, mask, cache)
    queries, keys = (normed.transpose(0, 2, 1, 3) for normed in normalized)
    values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
    queries, keys = head_norms.rotated_pair(self.rope, queries, keys, cache)
    if not self.attn_logit_softcapping:
        output = attention_output(self, queries, keys, values, cache, mask, B, L)
        return self.o_proj(output)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    output = sys.modules[type(self).__module__]._softcap_attention(
        queries, keys, values, scale=self.scale, softcap=self.attn_logit_softcapping, mask=mask,
    )
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _gear_conv_mixer_call(self, mode, x, mask=None, cache=None):
    """gear's conv mixer: q and k normalized, then flattened (no RoPE)."""
    B, L, _ = x.shape
    masked = self._apply_mask(x, mask)
    query = self.q_proj(masked).reshape(B, L, self.n_heads, self.head_dim)
    key = self.k_proj(masked).reshape(B, L, self.n_kv_heads, self.head_dim)
    normalized = head_norms.normalized_pair(query, key, self.q_norm, self.k_norm, mode)
    if normalized is None:  # before the caches change
        return original_call(self, x, mask, cache)
    query, key = (normed.reshape(B, L, -1) for normed in normalized)
    key = self._conv(key, self.key_conv, cache, cache_idx=0)
    value = self._conv(self.v_proj(masked), self.value_conv, cache, cache_idx=1)
    if cache is not None:
        cache.advance(L)
    key = self._expand_kv(key)
    value = self._expand_kv(value)
    return self.o_proj(mx.sigmoid(query * key) * value)


def _gemma3n_engages(attention) -> bool:
    return attention.is_kv_shared_layer is False and head_norms.norms_engage(
        attention.q_norm, attention.k_norm
    )


def _gemma4_text_engages(attention) -> bool:
    return attention.has_kv is True and head_norms.norms_engage(
        attention.q_norm, attention.k_norm
    )


def _gear_engages(attention) -> bool:
    return head_norms.norms_engage(attention.q_norm, attention.k_norm)


_KV_SHARED_REFUSAL = "it is KV-shared (q only is normalized), or " + REFUSAL

register_attention_families(
    AttentionFamily(
        "mlx_lm.models.gemma3n", "Gemma3nAttention", _gemma3n_attention_call, _gemma3n_engages,
        _KV_SHARED_REFUSAL, switches=(("is_kv_shared_layer", False),),
    ),
    AttentionFamily(
        "mlx_lm.models.gemma4_text", "Attention", _gemma4_text_attention_call,
        _gemma4_text_engages, _KV_SHARED_REFUSAL, switches=(("has_kv", True),),
    ),
    AttentionFamily(
        "mlx_lm.models.gear", "Attention", _gear_attention_call, _gear_engages, REFUSAL
    ),
    AttentionFamily(
        "mlx_lm.models.gear", "ConvKVGatedMixer", _gear_conv_mixer_call, _gear_engages, REFUSAL
    ),
)
