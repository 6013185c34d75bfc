"""Attention without q/k norms: mlx-lm's Llama family and its kin.

Most of mlx-lm's models (llama, which mistral, pixtral and smollm3 run;
qwen2 and qwen2_moe, which qwen2_vl runs; mixtral, gemma, phi3, granite,
deepseek, starcoder2, internlm2/3, ...) project q, k and v, split them into
heads, transpose them to ``(B, H, L, D)``, rotate q and k with the layer's
RoPE at the cache offset, then update the cache and attend. Their prework
is the norm + RoPE's without the norms, so it is the same one call, of a
:class:`~mlx_dualnorm.CompiledDualHeadNormRope` made without norms
(``eps=None``): the two transposes, the two RoPEs and, for a decode step
of one of mlx-lm's caches, both cache writes (:mod:`.cache_update`); on
MLX's CUDA backend one kernel launch.

Each family here restates its class's ``__call__`` with
:mod:`.qwen3_like`'s call, the parts named per family: how q, k and v are
projected (three projections, or one fused projection split as the class
splits it), the head counts, the output projection. A layer whose RoPE is
not one the package computes (``DynamicNTKScalingRoPE``, smollm3's
``NoPE``, a granite hybrid or cohere2 layer without RoPE), or whose
optional q/k norms are on (cohere's and stablelm's LayerNorms), runs its
class's own code. Where a class attends in its own way (gpt_oss's sinks,
cohere2's float32 queries, stablelm's float32 q and k, gemma2's
soft-capped scores written out, ministral3's scaled queries), the
replacement attends as it does.
"""

from __future__ import annotations

import math
import sys

import mlx.core as mx

from mlx_dualnorm.integrations.mlx_lm import qwen3_like
from mlx_dualnorm.integrations.mlx_lm.cache_update import attended, module_attention
from mlx_dualnorm.integrations.mlx_lm.engine import original_call
from mlx_dualnorm.integrations.mlx_lm.qwen3_like import (
    NO_NORMS,
    PartNames,
    attention_family,
    in_heads,
    no_norms,
    projected,
    rope_of,
    separate_projections,
)
from mlx_dualnorm.integrations.mlx_lm.registry import (
    AttentionFamily,
    register_attention_families,
)

REFUSAL = "its RoPE is not plain nn.RoPE or a frequency-table RoPE of rope_utils"


def _heads(heads: str, kv_heads: str, **parts) -> PartNames:
    """The parts of a family without q/k norms."""
    return PartNames(heads, kv_heads, no_norms, **parts)


def _phi3_projections(attention, x, batch, length, query_heads, kv_heads):
    """phi3's one ``qkv_proj``, split at the query and key widths."""
    qkv = attention.qkv_proj(x)
    query_end = attention.n_heads * attention.head_dim
    queries, keys, values = mx.split(
        qkv, [query_end, query_end + attention.n_kv_heads * attention.head_dim], axis=-1
    )
    return in_heads(queries, keys, values, batch, length, query_heads, kv_heads)


def _internlm2_projections(attention, x, batch, length, query_heads, kv_heads):
    """internlm2's grouped ``wqkv``: per key/value head, its query heads,
    then its key and its value."""
    head_dim = attention.head_dim
    grouped = attention.wqkv(x).reshape(batch, length, -1, 2 + attention.n_kv_groups, head_dim)
    queries = grouped[..., : attention.n_kv_groups, :].reshape(batch, length, -1, head_dim)
    return (
        queries.reshape(batch, length, query_heads, -1),
        grouped[..., -2, :].reshape(batch, length, kv_heads, -1),
        grouped[..., -1, :].reshape(batch, length, kv_heads, -1),
    )


def _dbrx_projections(attention, x, batch, length, query_heads, kv_heads):
    """dbrx's one ``Wqkv``, clipped, split at the model and key widths."""
    qkv = mx.clip(attention.Wqkv(x), a_min=-attention.clip_qkv, a_max=attention.clip_qkv)
    model_width = attention.d_model
    splits = [model_width, model_width + attention.head_dim * attention.num_key_value_heads]
    queries, keys, values = mx.split(qkv, splits, axis=-1)
    return in_heads(queries, keys, values, batch, length, query_heads, kv_heads)


def _qwen_projections(attention, x, batch, length, query_heads, kv_heads):
    """Qwen (1)'s one ``c_attn``, split in three equal parts."""
    queries, keys, values = mx.split(attention.c_attn(x), 3, axis=-1)
    return in_heads(queries, keys, values, batch, length, query_heads, kv_heads)


def _head_dim_projections(attention, x, batch, length, query_heads, kv_heads):
    """Three projections split into heads of ``head_dim`` (nemotron-nas)."""
    head_dim = attention.head_dim
    return (
        attention.q_proj(x).reshape(batch, length, query_heads, head_dim),
        attention.k_proj(x).reshape(batch, length, kv_heads, head_dim),
        attention.v_proj(x).reshape(batch, length, kv_heads, head_dim),
    )


def _lille_projections(attention, x, batch, length, query_heads, kv_heads):
    """lille-130m's one ``qkv_proj`` of the normalized input, split at the
    query and key widths."""
    qkv = attention.qkv_proj(attention.norm(x))
    query_size = attention.n_head * attention.head_dim
    key_size = attention.n_kv_heads * attention.head_dim
    queries, keys, values = mx.split(qkv, [query_size, query_size + key_size], axis=-1)
    return in_heads(queries, keys, values, batch, length, query_heads, kv_heads)


def _gpt_oss_projections(attention, x, batch, length, query_heads, kv_heads):
    """gpt_oss's three projections, split into heads of ``head_dim`` (the
    head counts follow from it: its class reads no head count)."""
    head_dim = attention.head_dim
    return (
        attention.q_proj(x).reshape(batch, length, -1, head_dim),
        attention.k_proj(x).reshape(batch, length, -1, head_dim),
        attention.v_proj(x).reshape(batch, length, -1, head_dim),
    )


def _gpt_oss_attend(attention, queries, keys, values, cache, mask, batch, length):
    """gpt_oss's attention: its scale and its per-head sinks."""
    output = module_attention(attention)(
        queries, keys, values, cache, attention.sm_scale, mask=mask, sinks=attention.sinks
    )
    return output.swapaxes(1, 2).reshape(batch, length, -1)


def _cohere2_attend(attention, queries, keys, values, cache, mask, batch, length):
    """cohere2's attention: float16 queries attend in float32, the output
    cast back."""
    attention_dtype = mx.float32 if queries.dtype == mx.float16 else queries.dtype
    output = module_attention(attention)(
        queries.astype(attention_dtype), keys, values, cache=cache, scale=attention.scale,
        mask=mask,
    ).astype(queries.dtype)
    return output.transpose(0, 2, 1, 3).reshape(batch, length, -1)


def _stablelm_attend(attention, queries, keys, values, cache, mask, batch, length):
    """stablelm's attention: rotated q and k in float32, the scale from the
    head width, the output in the values' dtype."""
    queries = queries.astype(mx.float32)
    keys = keys.astype(mx.float32)
    scale = math.sqrt(1 / queries.shape[-1])
    output = module_attention(attention)(
        queries, keys, values, cache=cache, scale=scale, mask=mask
    ).astype(values.dtype)
    return output.transpose(0, 2, 1, 3).reshape(batch, length, -1)


def _gemma2_attend(attention, queries, keys, values, cache, mask, batch, length):
    """gemma2's attention, written out as its class writes it: scaled
    queries, soft-capped scores, the mask, a precise softmax."""
    queries = queries * attention.scale
    repeats = attention.repeats
    if repeats > 1:
        queries = queries.reshape(
            batch, attention.n_kv_heads, repeats, length, attention.head_dim
        )
        keys = mx.expand_dims(keys, 2)
        values = mx.expand_dims(values, 2)
    scores = queries @ keys.swapaxes(-1, -2)
    softcapping = attention.attn_logit_softcapping
    scores = mx.tanh(scores / softcapping)
    scores *= softcapping
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    scores = mx.softmax(scores, precise=True, axis=-1)
    output = scores @ values
    if repeats > 1:
        output = output.reshape(batch, attention.n_heads, length, attention.head_dim)
    return output.transpose(0, 2, 1, 3).reshape(batch, length, -1)


def _norms_off(flag: str):
    """The norms of a class whose optional q/k norms (``flag``) are not
    RMS norms the package computes: none where the flag is off (the RoPE
    alone), else None (the layer runs its class's code)."""

    def read(attention):
        return None if getattr(attention, flag) else NO_NORMS

    return read


def _exaone_finish(attention, x, output, batch, length):
    """exaone's output: back to the input's width ``D``, then ``out_proj``."""
    return attention.out_proj(output.reshape(batch, length, x.shape[-1]))


_N_HEADS = _heads("n_heads", "n_kv_heads")

# Where a class's optional q/k norms are on (LayerNorms), its layers are
# left alone for that reason.
_REFUSALS = {
    "cohere": "its q/k norms are on (LayerNorm2D), or " + REFUSAL,
    "stablelm": "its q/k norms are on (per-head LayerNorm), or " + REFUSAL,
    "cohere2": "it has no RoPE (a global layer), or " + REFUSAL,
}

ROPE_ONLY_FAMILIES = tuple(
    attention_family(module, class_name, parts, _REFUSALS.get(module, REFUSAL))
    for module, class_name, parts in (
        ("llama", "Attention", _N_HEADS),
        ("qwen2", "Attention", _N_HEADS),
        ("qwen2_moe", "Attention", _N_HEADS),
        ("mixtral", "MixtralAttention", _heads("num_heads", "num_key_value_heads")),
        ("gemma", "Attention", _N_HEADS),
        ("deepseek", "DeepseekAttention", _heads("num_attention_heads", "num_kv_heads")),
        ("ernie4_5", "Attention", _N_HEADS),
        ("ernie4_5_moe", "Attention", _N_HEADS),
        ("glm", "GLMAttention", _heads("num_attention_heads", "num_key_value_heads")),
        ("glm4", "Glm4Attention", _N_HEADS),
        ("granite", "Attention", _N_HEADS),
        ("granitemoe", "GraniteMoeAttention", _N_HEADS),
        ("granitemoehybrid", "GraniteMoeHybridAttention", _N_HEADS),
        ("helium", "HeliumAttention", _N_HEADS),
        ("internlm3", "Attention", _N_HEADS),
        ("mimo", "Attention", _N_HEADS),
        ("minicpm", "Attention", _heads("num_heads", "num_key_value_heads")),
        ("nanbeige", "Attention", _N_HEADS),
        ("nemotron", "Attention", _N_HEADS),
        ("phimoe", "Attention", _N_HEADS),
        ("seed_oss", "Attention", _N_HEADS),
        ("starcoder2", "Attention", _N_HEADS),
        ("telechat3", "Telechat3Attention", _heads("num_attention_heads", "num_key_value_heads")),
        ("falcon_h1", "FalconH1Attention", _heads("num_heads", "num_kv_heads")),
        ("nemotron-nas", "Attention", _heads("n_heads", "n_kv_heads",
                                             projections=_head_dim_projections)),
        ("exaone", "AttentionModule", _heads("n_heads", "n_kv_heads", finish=_exaone_finish)),
        ("phi3", "Attention", _heads("n_heads", "n_kv_heads", projections=_phi3_projections)),
        ("internlm2", "Attention", _heads("n_heads", "n_kv_heads", finish=projected("wo"),
                                          projections=_internlm2_projections)),
        ("dbrx", "Attention", _heads("num_heads", "num_key_value_heads",
                                     finish=projected("out_proj"),
                                     projections=_dbrx_projections)),
        ("qwen", "Attention", _heads("num_attention_heads", "num_attention_heads",
                                     rope=rope_of(name="rotary_emb"), finish=projected("c_proj"),
                                     projections=_qwen_projections)),
        ("lille-130m", "Lille130mAttention", _heads("n_head", "n_kv_heads",
                                                    finish=projected("out_proj"),
                                                    projections=_lille_projections)),
        ("gpt_oss", "AttentionBlock", _heads("", "", projections=_gpt_oss_projections,
                                             attend=_gpt_oss_attend, mask_required=True)),
        ("gemma2", "Attention", _heads("n_heads", "n_kv_heads", attend=_gemma2_attend)),
        ("cohere2", "Attention", _heads("n_heads", "n_kv_heads", rope=rope_of("use_sliding_window"),
                                        attend=_cohere2_attend)),
        ("cohere", "Attention", PartNames("n_heads", "n_kv_heads", _norms_off("use_qk_norm"))),
        ("stablelm", "Attention", PartNames("num_heads", "num_key_value_heads",
                                            _norms_off("qk_layernorm"),
                                            attend=_stablelm_attend)),
    )
)


def _ministral3_call(self, mode, x, attn_scale=None, mask=None, cache=None):
    """ministral3's attention, whose call takes ``attn_scale`` (Llama 4's
    position scaling of the queries) before the mask: the RoPE-only call,
    then the rotated queries times the scale, computed as the class does
    where the caller gives none, from the offset before the cache update."""
    batch, length, _ = x.shape
    offset = 0 if cache is None else cache.offset
    queries, keys, values = separate_projections(
        self, x, batch, length, self.n_heads, self.n_kv_heads
    )
    prepared = qwen3_like.prework(_N_HEADS, self, mode, queries, keys, values, cache)
    if prepared is None:
        return original_call(self, x, attn_scale, mask, cache)
    rotated_queries, keys, values = prepared
    if attn_scale is None:
        scale_of = sys.modules[type(self).__module__]._get_llama_4_attn_scale
        attn_scale = scale_of(
            length, offset, self.scaling_beta, self.original_max_position_embeddings
        ).astype(x.dtype)
    output = attended(self, rotated_queries * attn_scale, keys, values, cache, mask, batch, length)
    return self.o_proj(output)


MINISTRAL3_FAMILY = AttentionFamily(
    "mlx_lm.models.ministral3", "Attention", _ministral3_call,
    lambda attention: qwen3_like.engages(_N_HEADS, attention), REFUSAL,
)

register_attention_families(*ROPE_ONLY_FAMILIES, MINISTRAL3_FAMILY)
