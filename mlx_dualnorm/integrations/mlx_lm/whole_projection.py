"""Attention layers that normalize the whole q and k projections.

``olmo2``, ``olmo3``, ``olmoe``, ``minimax`` (with ``use_qk_norm``) and
``olmo_hybrid``'s full attention normalize q and k over their whole
``H * D`` width, right after the projections, and only then split them into
heads, transpose and rotate per head. Where the layer's RoPE is one the
norm + RoPE call computes, the replacements make the norms, the split, the
transpose, the RoPE and (for the caches
:func:`.cache_update.prework_and_cache_update` writes) the cache write
ONE call of :class:`~mlx_dualnorm.CompiledDualHeadNormRope`,
whose weights of ``H * D`` elements normalize each token's heads together;
elsewhere (no RoPE, another RoPE class) the two norm calls are one
:func:`~.head_norms.normalized_pair` call at that width, and the reshapes,
the layer's own RoPE, the cache update and the attention are mlx-lm's. A
sharded norm (the ``minimax`` tensor-parallel one) is not a known norm
class: those layers run the class's own ``__call__``.
"""

from __future__ import annotations

import dataclasses

from mlx_dualnorm.integrations.mlx_lm import cache_update, head_norms
from mlx_dualnorm.integrations.mlx_lm.cache_update import (
    attended,
)
from mlx_dualnorm.integrations.mlx_lm.engine import original_call
from mlx_dualnorm.integrations.mlx_lm.registry import (
    AttentionFamily,
    register_attention_families,
)
from mlx_dualnorm.integrations.mlx_lm.norm_after_transpose import REFUSAL


def _attend_normalized_projections(
    attention, mode, x, mask, cache, heads, kv_heads, rope_optional=False
):
    """The layer's output. Where the layer's norms and RoPE are what the
    norm + RoPE call computes, its q/k prework (with the cache write where
    the cache allows) is ONE call: the projections as ``(B, L, H, D)``
    heads, the norm weights of ``H * D`` elements, which make the call
    normalize each token's heads together, as mlx-lm does before the split.
    Otherwise the two norms are one call at the projections' width, and the
    rest is mlx-lm's code. The class's own ``__call__`` where neither
    computes the layer. The package's objects are built in ``mode``."""
    B, L, _ = x.shape
    query_norm, key_norm = attention.q_norm, attention.k_norm
    projections = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    queries, keys, values = (
        projected.reshape(B, L, heads_of, -1)
        for projected, heads_of in zip(projections, (heads, kv_heads, kv_heads))
    )
    rope = attention.rope
    prework = None
    if rope is not None:
        prework = head_norms.norm_rope_prework(
            "the whole-projection norm + RoPE", rope, query_norm, key_norm, queries, keys,
            mode,
        )
    prepared = None
    if prework is not None:
        prepared = cache_update.prework_and_cache_update(prework, queries, keys, values, cache)
    if prepared is None:
        normalized = head_norms.normalized_pair(*projections[:2], query_norm, key_norm, mode)
        if normalized is None:
            return original_call(attention, x, mask, cache)
        queries = normalized[0].reshape(B, L, heads, -1).transpose(0, 2, 1, 3)
        keys = normalized[1].reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
        if rope is not None or not rope_optional:
            queries, keys = head_norms.rotated_pair(rope, queries, keys, cache)
        prepared = cache_update.with_cache_update(queries, keys, values, cache)
    output = attended(attention, *prepared, cache, mask, B, L)
    return attention.o_proj(output)


def _olmo2_attention_call(self, mode, x, mask=None, cache=None):
    """olmo2 and olmoe."""
    return _attend_normalized_projections(
        self, mode, x, mask, cache, self.n_heads, self.n_kv_heads
    )


def _olmo3_attention_call(self, mode, x, mask=None, cache=None):
    """olmo3 and minimax."""
    return _attend_normalized_projections(
        self, mode, x, mask, cache, self.num_attention_heads, self.num_key_value_heads
    )


def _olmo_hybrid_attention_call(self, mode, x, mask=None, cache=None):
    """olmo_hybrid's full attention, whose RoPE may be absent."""
    return _attend_normalized_projections(
        self, mode, x, mask, cache, self.num_attention_heads, self.num_key_value_heads,
        rope_optional=True,
    )


def _projection_norms_engage(attention) -> bool:
    if getattr(attention, "use_qk_norm", True) is not True:  # minimax's flag
        return False
    return head_norms.norms_engage(
        getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    )


def _family(module: str, class_name: str, call) -> AttentionFamily:
    return AttentionFamily(module, class_name, call, _projection_norms_engage, REFUSAL)


register_attention_families(
    _family("mlx_lm.models.olmo2", "Attention", _olmo2_attention_call),
    _family("mlx_lm.models.olmoe", "Attention", _olmo2_attention_call),
    _family("mlx_lm.models.olmo3", "Olmo3Attention", _olmo3_attention_call),
    dataclasses.replace(
        _family("mlx_lm.models.minimax", "MiniMaxAttention", _olmo3_attention_call),
        switches=(("use_qk_norm", True),),  # read by its own code at every call
    ),
    _family("mlx_lm.models.olmo_hybrid", "Attention", _olmo_hybrid_attention_call),
)
