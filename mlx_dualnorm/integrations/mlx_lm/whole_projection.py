"""Attention layers that normalize the whole q and k projections.

``olmo2``, ``olmo3``, ``olmoe``, ``minimax`` (with ``use_qk_norm``) and
``olmo_hybrid``'s full attention normalize q and k over their whole
``H * D`` width, right after the projections, and only then split them into
heads, transpose and rotate per head. The replacements make the two norm
calls one :func:`~.head_norms.normalized_pair` call at that width, on the
projections themselves, and keep the reshapes, the layer's own RoPE, the
cache update and the attention as mlx-lm writes them. A sharded norm (the
``minimax`` tensor-parallel one) is not a known norm class: those layers
run the class's own ``__call__``.
"""

from __future__ import annotations

from mlx_dualnorm.integrations.mlx_lm import head_norms
from mlx_dualnorm.integrations.mlx_lm.full_attention import (
    AttentionFamily,
    _attention_output,
    register_attention_families,
)
from mlx_dualnorm.integrations.mlx_lm.heads_first import REFUSAL


def _attend_normalized_projections(
    attention, x, mask, cache, heads, kv_heads, rope_optional=False
):
    """The layer's output, its q/k projections normalized in one call; the
    class's own ``__call__`` where the pair is not what the package computes."""
    B, L, _ = x.shape
    normalized = head_norms.normalized_pair(
        attention.q_proj(x), attention.k_proj(x), attention.q_norm, attention.k_norm
    )
    if normalized is None:
        return type(attention).mlx_dualnorm_original_call(attention, x, mask, cache)
    queries, keys = normalized
    queries = queries.reshape(B, L, heads, -1).transpose(0, 2, 1, 3)
    keys = keys.reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
    values = attention.v_proj(x).reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
    if attention.rope is not None or not rope_optional:
        queries, keys = head_norms.rotated_pair(attention.rope, queries, keys, cache)
    output = _attention_output(attention, queries, keys, values, cache, mask, B, L)
    return attention.o_proj(output)


def _olmo2_attention_call(self, x, mask=None, cache=None):
    """olmo2 and olmoe."""
    return _attend_normalized_projections(self, x, mask, cache, self.n_heads, self.n_kv_heads)


def _olmo3_attention_call(self, x, mask=None, cache=None):
    """olmo3 and minimax."""
    return _attend_normalized_projections(
        self, x, mask, cache, self.num_attention_heads, self.num_key_value_heads
    )


def _olmo_hybrid_attention_call(self, x, mask=None, cache=None):
    """olmo_hybrid's full attention, whose RoPE may be absent."""
    return _attend_normalized_projections(
        self, x, mask, cache, self.num_attention_heads, self.num_key_value_heads,
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
    _family("mlx_lm.models.minimax", "MiniMaxAttention", _olmo3_attention_call),
    _family("mlx_lm.models.olmo_hybrid", "Attention", _olmo_hybrid_attention_call),
)
