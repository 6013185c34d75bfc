"""Attention layers that normalize q and k after the transpose to ``(B, H, L, D)``.

``afmoe``, ``openelm``, ``bailing_moe``, ``bailing_moe_linear`` (its full
and linear attention), ``bailing_hybrid`` (its linear attention, the layers
with q/k norms), ``gemma3_text``, ``minimax_m3_vl`` and ``plamo3``
reshape and transpose their projections first, then call ``q_norm`` /
``k_norm`` (or ``query_layernorm`` / ``key_layernorm``) on the ``(B, H, L,
D)`` arrays, then the layer's RoPE. The replacements here run that code with
the two norm calls made one :func:`~.head_norms.normalized_pair` call on the
same transposed arrays, and the layer's own RoPE module after it, called as
mlx-lm calls it: whatever RoPE class the layer has (scaled ones included),
the ops are mlx-lm's. In ``openelm``, ``bailing_moe``, ``bailing_moe_linear``
(full attention), ``gemma3_text`` and ``plamo3`` a one-token call (decode)
whose RoPE the norm + RoPE call covers makes the norms, the transpose, the
RoPE and (for the caches :func:`.cache_update.prework_and_cache_update`
writes) the cache write ONE call of
:class:`~mlx_dualnorm.CompiledDualHeadNormRope` instead. A layer
whose norms are off (a flag such as ``use_qk_norm`` unset) or not a known
norm class runs the class's own ``__call__``.
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


def _model_module(attention):
    """The model module of a layer: its code looks names up there at each call."""
    return sys.modules[type(attention).__module__]


def _projected_attention(
    attention, mode, output_projection, projections, norms, call_arguments
):
    """``output_projection`` of the attention over queries, keys and values
    given as ``(B, L, H, D)`` heads. mlx-lm transposes them to ``(B, H, L,
    D)`` before its norms. A one-token call (decode) whose norms and RoPE
    are what the norm + RoPE call computes makes the q/k prework (with the
    cache write, where the cache allows) ONE call, which normalizes before
    the transpose: for ``L == 1`` both layouts hold the rows in the same
    order, so the forward AND a norm weight's gradient, which sums over the
    rows in their order, have mlx-lm's bits. Any other call transposes q and
    k as mlx-lm does, normalizes them by ``norms`` in one call and rotates
    them by the layer's RoPE. The class's own ``__call__`` on
    ``call_arguments`` (x, mask, cache) where neither computes the layer.
    The package's objects are built in ``mode``."""
    queries, keys, values = projections
    _, mask, cache = call_arguments
    prepared = prework = None
    if queries.shape[1] == 1:
        prework = head_norms.norm_rope_prework(
            "the heads-first norm + RoPE", attention.rope, *norms, queries, keys, mode
        )
    if prework is not None:
        prepared = cache_update.prework_and_cache_update(prework, queries, keys, values, cache)
    if prepared is None:
        queries, keys, values = (_heads_first(heads) for heads in projections)
        normalized = head_norms.normalized_pair(queries, keys, *norms, mode)
        if normalized is None:
            return original_call(attention, *call_arguments)
        queries, keys = head_norms.rotated_pair(attention.rope, *normalized, cache)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        prepared = queries, keys, values
    batch, _, length, _ = prepared[0].shape
    output = attended(attention, *prepared, cache, mask, batch, length)
    return output_projection(output)


def _heads(projected, batch, length, heads, head_dim):
    """A (B, L, heads * head_dim) projection as (B, L, H, D) heads."""
    return projected.reshape(batch, length, heads, head_dim)


def _heads_first(heads):
    """(B, L, H, D) heads as mlx-lm's (B, H, L, D)."""
    return heads.transpose(0, 2, 1, 3)


def _projections(attention, x, heads, kv_heads, head_dim):
    """The layer's q, k and v projections of ``x``, each (B, L, H, D)."""
    batch, length, _ = x.shape
    return (
        _heads(attention.q_proj(x), batch, length, heads, head_dim),
        _heads(attention.k_proj(x), batch, length, kv_heads, head_dim),
        _heads(attention.v_proj(x), batch, length, kv_heads, head_dim),
    )


def _normalized_projections_heads_first(attention, mode, x, heads, kv_heads, head_dim):
    """The layer's (B, H, L, D) q, k and v projections of ``x``, q and k
    normalized by ``q_norm`` / ``k_norm`` in one call; None where the pair
    is not what the package computes."""
    projections = _projections(attention, x, heads, kv_heads, head_dim)
    queries, keys, values = (_heads_first(heads) for heads in projections)
    normalized = head_norms.normalized_pair(
        queries, keys, attention.q_norm, attention.k_norm, mode
    )
    return None if normalized is None else (*normalized, values)


def _split_heads(projected, batch, length, heads, head_dims):
    """Queries, keys and values of one fused (B, L, ...) projection, split
    as mlx-lm splits it (at the query and key widths), each (B, L, H, D)."""
    query_size, key_size = heads[0] * head_dims[0], heads[1] * head_dims[1]
    parts = mx.split(projected, [query_size, query_size + key_size], axis=-1)
    return [
        _heads(part, batch, length, part_heads, head_dim)
        for part, part_heads, head_dim in zip(parts, heads, head_dims)
    ]


def _afmoe_attention_call(self, mode, x, mask=None, cache=None):
    """afmoe: gated attention; only its sliding-window layers have a RoPE."""
    B, L, _ = x.shape
    projections = _normalized_projections_heads_first(
        self, mode, x, self.n_heads, self.n_kv_heads, self.head_dim
    )
    if projections is None:
        return original_call(self, x, mask, cache)
    queries, keys, values = projections
    if self.is_local_attention and self.rope is not None:
        queries, keys = head_norms.rotated_pair(self.rope, queries, keys, cache)
    output = attention_output(self, queries, keys, values, cache, mask, B, L)
    gate = mx.sigmoid(self.gate_proj(x))
    return self.o_proj(output * gate)


def _openelm_attention_call(self, mode, x, mask=None, cache=None):
    B, L, _ = x.shape
    qkv = self.qkv_proj(x).reshape(B, L, self.n_heads + (self.n_kv_heads * 2), self.head_dim)
    queries, keys, values = mx.split(qkv, [self.n_heads, self.n_heads + self.n_kv_heads], axis=2)
    return _projected_attention(
        self, mode, self.out_proj, (queries, keys, values), (self.q_norm, self.k_norm),
        (x, mask, cache),
    )


def _bailing_attention_call(self, mode, x, mask=None, cache=None):
    """bailing_moe's and bailing_moe_linear's full attention."""
    B, L, _ = x.shape
    heads = (self.num_attention_heads, self.num_key_value_heads, self.num_key_value_heads)
    queries, keys, values = _split_heads(
        self.query_key_value(x), B, L, heads, (self.head_dim,) * 3
    )
    return _projected_attention(
        self, mode, self.dense, (queries, keys, values),
        (self.query_layernorm, self.key_layernorm), (x, mask, cache),
    )


def _lightning_attention(self, mode, x, mask, cache, offset, hybrid):
    """bailing_moe_linear's and bailing_hybrid's linear attention: RoPE at
    the model's ``offset``, then the model's recurrence (bailing_hybrid's
    takes the mask and advances a cache that can)."""
    B, L, _ = x.shape
    heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
    qkv = self.query_key_value(x).reshape(B, L, heads + 2 * kv_heads, self.head_dim)
    q, k, v = mx.split(qkv, [heads, heads + kv_heads], axis=2)
    queries, keys = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    values = v.transpose(0, 2, 1, 3)
    normalized = head_norms.normalized_pair(
        queries, keys, self.query_layernorm, self.key_layernorm, mode
    )
    if normalized is None:
        return original_call(self, x, mask, cache, offset)
    queries, keys = normalized
    queries = self.rope(queries, offset=offset)
    keys = self.rope(keys, offset=offset)
    if cache is None:
        cache = [None]
    output, cache[0] = _model_module(self).recurrent_gla(
        q=queries, k=keys, v=values, g=self._slope, scale=self.scale, h=cache[0],
        **({"mask": mask} if hybrid else {}),
    )
    if hybrid and hasattr(cache, "advance"):
        cache.advance(L)
    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
    output = self.g_norm(output) * mx.sigmoid(self.g_proj(x))
    return self.dense(output)


def _bailing_linear_attention_call(self, mode, x, mask=None, cache=None, offset=0):
    return _lightning_attention(self, mode, x, mask, cache, offset, hybrid=False)


def _bailing_hybrid_linear_attention_call(self, mode, x, mask=None, cache=None, offset=0):
    return _lightning_attention(self, mode, x, mask, cache, offset, hybrid=True)


def _gemma3_text_attention_call(self, mode, x, mask=None, cache=None):
    """gemma3_text: norms of weight ``1.0 + w``."""
    B, L, _ = x.shape
    queries, keys, values = _projections(self, x, self.n_heads, self.n_kv_heads, -1)
    return _projected_attention(
        self, mode, self.o_proj, (queries, keys, values), (self.q_norm, self.k_norm),
        (x, mask, cache),
    )


def _plamo3_attention_call(self, mode, hidden_states, mask=None, cache=None):
    """plamo3: norms of weight ``w + offset`` (their ``scale``)."""
    B, L, _ = hidden_states.shape
    queries, keys, values = _split_heads(
        self.qkv_proj(hidden_states), B, L,
        (self.q_num_heads, self.k_num_heads, self.v_num_heads),
        (self.qk_dim, self.qk_dim, self.v_dim),
    )
    return _projected_attention(
        self, mode, self.o_proj, (queries, keys, values), (self.q_norm, self.k_norm),
        (hidden_states, mask, cache),
    )


def _minimax_m3_attention_call(self, mode, x, mask=None, cache=None):
    """minimax_m3_vl: a KV cache and an indexer cache, RoPE at the KV
    cache's offset, the indexer's block mask on sparse layers."""
    B, L, _ = x.shape
    kv_cache = cache[0] if cache is not None else None
    offset = kv_cache.offset if kv_cache is not None else 0
    projections = _normalized_projections_heads_first(
        self, mode, x, self.num_attention_heads, self.num_key_value_heads, self.head_dim
    )
    if projections is None:
        return original_call(self, x, mask, cache)
    q, k, v = projections
    q = self.rope(q, offset=offset)
    k = self.rope(k, offset=offset)
    if self.is_sparse_attn:
        mask = self._block_mask(x, mask, offset, cache[1] if cache is not None else None)
    if kv_cache is not None:
        k, v = kv_cache.update_and_fetch(k, v)
        if self.is_sparse_attn:
            index_kv = [cache[1].keys, cache[1].values]
            kv_cache.keys = mx.depends(kv_cache.keys, index_kv)
    attend = _model_module(self).scaled_dot_product_attention
    out = attend(q, k, v, cache=kv_cache, scale=self.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return self.o_proj(out)


def _norms_engage(query_norm_name, key_norm_name, flag=None):
    """A predicate: the layer has ``flag`` set (where given) and its two
    norms are a pair :func:`~.head_norms.normalized_pair` computes."""

    def engages(attention) -> bool:
        if flag is not None and getattr(attention, flag, False) is not True:
            return False
        query_norm = getattr(attention, query_norm_name, None)
        key_norm = getattr(attention, key_norm_name, None)
        return head_norms.norms_engage(query_norm, key_norm)

    return engages


_QK_NORMS = _norms_engage("q_norm", "k_norm")
_BAILING_NORMS = _norms_engage("query_layernorm", "key_layernorm", flag="use_qk_norm")
REFUSAL = "its q/k norms are off, or not a known norm class with one plain eps"
# The switch these classes' own code reads at every call: a layer engaged
# with it on runs that code at any call where it is off.
_USE_QK_NORM = (("use_qk_norm", True),)

register_attention_families(
    AttentionFamily("mlx_lm.models.afmoe", "Attention", _afmoe_attention_call, _QK_NORMS, REFUSAL),
    AttentionFamily(
        "mlx_lm.models.openelm", "Attention", _openelm_attention_call,
        _norms_engage("q_norm", "k_norm", flag="normalize_qk_projections"), REFUSAL,
        switches=(("normalize_qk_projections", True),),
    ),
    AttentionFamily(
        "mlx_lm.models.bailing_moe", "BailingMoeAttention", _bailing_attention_call,
        _BAILING_NORMS, REFUSAL, switches=_USE_QK_NORM,
    ),
    AttentionFamily(
        "mlx_lm.models.bailing_moe_linear", "Attention", _bailing_attention_call,
        _BAILING_NORMS, REFUSAL, switches=_USE_QK_NORM,
    ),
    AttentionFamily(
        "mlx_lm.models.bailing_moe_linear", "LinearAttention",
        _bailing_linear_attention_call, _BAILING_NORMS, REFUSAL, switches=_USE_QK_NORM,
    ),
    AttentionFamily(
        "mlx_lm.models.bailing_hybrid", "LinearAttention",
        _bailing_hybrid_linear_attention_call, _BAILING_NORMS, REFUSAL, switches=_USE_QK_NORM,
    ),
    AttentionFamily(
        "mlx_lm.models.gemma3_text", "Attention", _gemma3_text_attention_call, _QK_NORMS, REFUSAL
    ),
    AttentionFamily(
        "mlx_lm.models.plamo3", "Attention", _plamo3_attention_call, _QK_NORMS, REFUSAL
    ),
    AttentionFamily(
        "mlx_lm.models.minimax_m3_vl", "Attention", _minimax_m3_attention_call,
        _norms_engage("q_norm", "k_norm", flag="use_qk_norm"), REFUSAL, switches=_USE_QK_NORM,
    ),
)
