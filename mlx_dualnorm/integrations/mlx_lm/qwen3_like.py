"""Attention of other mlx-lm families with qwen3's q/k prework.

These families' attention runs what qwen3's does: per-head RMS norm of q
and k with one epsilon, a transpose to ``(B, H, L, D)``, RoPE at the cache
offset, the cache update and attention, with other attribute names:

* ``Klear``, ``dots1``, ``lfm2``, ``lfm2_moe``, ``mellum``, ``apertus``:
  ``nn.RMSNorm`` and ``nn.RoPE``; ``exaone4`` and ``exaone_moe`` as well,
  where a layer without RoPE (``use_rope`` false) has its norm alone fused
  (:class:`~mlx_dualnorm.CompiledDualHeadNorm`, then the transpose).
* ``glm4_moe`` (which ``solar_open`` runs) and ``laguna``: RoPE of fewer
  dims than the head (partial rotary); laguna's softplus output gate after
  attention. A glm4_moe layer without q/k norms (``use_qk_norm`` false)
  takes the RoPE alone (the call made without norms, as :mod:`.rope_only`'s
  families).
* ``step3p5``: ``ZeroCenteredRMSNorm``, whose call is nn.RMSNorm's own
  expression ``mx.fast.rms_norm(x, self.weight, self.eps)``; partial rotary,
  the sigmoid head gate after attention.
* ``llama4_text``: ``mx.fast.rms_norm(x, None, rms_norm_eps)`` (no weight)
  when ``use_qk_norm`` (else the RoPE alone), traditional RoPE where
  ``use_rope``.

Each replacement runs every other op as mlx-lm writes it, except that
with mlx-lm's ``KVCache``, ``RotatingKVCache`` and their batched classes a
decode step's cache write joins the norm + RoPE call
(:func:`.cache_update.prework_and_cache_update`). A layer whose
norms or RoPE are not exactly what the package computes (a RoPE other
than ``nn.RoPE`` and the frequency-table RoPEs of ``rope_utils``, other
norms, norms of two epsilons)
runs its class's own ``__call__``, decided at its first call
(:mod:`.norm_rope`, :mod:`.cache_update`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.normalization import RMSNorm

from mlx_dualnorm.dual_head_norm import CompiledDualHeadNorm
from mlx_dualnorm.integrations.mlx_lm import cache_update, head_norms, norm_rope, registry
from mlx_dualnorm.integrations.mlx_lm.prework_log import NORM_ONLY, note_prework
from mlx_dualnorm.integrations.mlx_lm.state import STATE
from mlx_dualnorm.integrations.mlx_lm._shared import PLAIN_SCALAR_TYPES, log_fallback_once
from mlx_dualnorm.integrations.mlx_lm.cache_update import (
    attended,
)
from mlx_dualnorm.integrations.mlx_lm.norm_rope import (
    is_plain_norm_rope,
    module_item,
)
from mlx_dualnorm.integrations.mlx_lm.engine import original_call
from mlx_dualnorm.integrations.mlx_lm.registry import (
    AttentionFamily,
    register_attention_families,
)

# What a layer's norms read as: (query_norm, key_norm, query_weight,
# key_weight), the norms being nn.RMSNorm modules whose eps and types decide
# what is built; NO_NORMS where the layer has none (its q/k norms switched
# off, or a family without them: the prework is the RoPE alone); None
# where its norms are not ones the package computes (the layer is then
# left alone).
NormsRead = Optional[tuple]
NO_NORMS = (None, None, None, None)


def no_norms(attention) -> NormsRead:
    """The norms of attention without q/k norms (mlx-lm's Llama family)."""
    return NO_NORMS


def _item(module, name: str):
    """``module.name``, read as a dict item where it is one (the quick way,
    see norm_rope.module_item); raises AttributeError where absent."""
    value = module_item(module, name)
    return getattr(module, name) if value is None else value


# ---- How a family's layer holds its norms and RoPE ------------------------------


def _rms_norms(query_name: str = "q_norm", key_name: str = "k_norm", flag: str = ""):
    """Reads the norm modules ``query_name`` / ``key_name`` (whether they
    are plain nn.RMSNorm is checked where they are used); with a ``flag``
    attribute, only where it is true (NO_NORMS otherwise: the class's code
    then rotates q and k unnormalized)."""

    def read(attention) -> NormsRead:
        if flag and not getattr(attention, flag):
            return NO_NORMS
        query_norm, key_norm = _item(attention, query_name), _item(attention, key_name)
        # As nn.RMSNorm reads its weight (``self["weight"]``): a norm without
        # one raises here, and the class's own code raises as unpatched.
        return query_norm, key_norm, query_norm["weight"], key_norm["weight"]

    return read


def _zero_centered_norms(attention) -> NormsRead:
    """step3p5's norms: ZeroCenteredRMSNorm computes
    ``mx.fast.rms_norm(x, self.weight, self.eps)``, nn.RMSNorm's expression,
    so an nn.RMSNorm of their one eps stands for both (None where their
    types or eps differ: the layer is then left alone)."""
    zero_centered = _zero_centered_class()
    query_norm, key_norm = _item(attention, "q_norm"), _item(attention, "k_norm")
    if not (type(query_norm) is type(key_norm) is zero_centered):
        return None
    eps = query_norm.eps
    if type(key_norm.eps) is not type(eps) or key_norm.eps != eps:
        return None
    stand_in = head_norms.stand_in_norm(eps)
    return stand_in, stand_in, _item(query_norm, "weight"), _item(key_norm, "weight")


_ZERO_CENTERED: list = []


def _zero_centered_class():
    """step3p5's ZeroCenteredRMSNorm, as that module defines it (found once)."""
    if not _ZERO_CENTERED:
        _ZERO_CENTERED.append(registry.defined_class("mlx_lm.models.step3p5", "ZeroCenteredRMSNorm"))
    return _ZERO_CENTERED[0]


def _weightless_norms(attention) -> NormsRead:
    """llama4_text's ``mx.fast.rms_norm(x, None, self.rms_norm_eps)`` on q
    and k where ``use_qk_norm``: an nn.RMSNorm of that eps stands for it,
    with no weight (NO_NORMS where it is off)."""
    if not attention.use_qk_norm:
        return NO_NORMS
    stand_in = head_norms.stand_in_norm(attention.rms_norm_eps)
    return stand_in, stand_in, None, None


def rope_of(flag: str = "", name: str = "rope"):
    """Reads the layer's RoPE module (``name``); with a ``flag`` attribute,
    only where it is true (None: the layer has no RoPE)."""

    def read(attention):
        if flag and not getattr(attention, flag):
            return None
        return _item(attention, name)

    return read


# ---- What runs after attention ------------------------------------------------


def projected(name: str = "o_proj"):
    """Attention's output through the output projection ``name``."""

    def finish(attention, x, output, batch, length):
        return _item(attention, name)(output)

    return finish


def _laguna_finish(self, x, output, batch, length):
    """laguna's optional softplus gate per head, then o_proj, as mlx-lm."""
    if self.gating:
        gate = nn.softplus(self.g_proj(x).astype(mx.float32)).astype(output.dtype)
        output = output.reshape(batch, length, self.n_heads, self.head_dim)
        output = (output * gate[..., None]).reshape(batch, length, -1)
    return self.o_proj(output)


def _step3p5_finish(self, x, output, batch, length):
    """step3p5's optional sigmoid gate per head, then o_proj. mlx-lm gates
    the (B, L, H, D) transpose of attention's output; the same values in
    (B, L, H, D) order here, multiplied elementwise by the same gate."""
    if self.use_head_wise_attn_gate:
        output = output.reshape(batch, length, self.num_heads, -1)
        output = output * mx.sigmoid(self.g_proj(x))[..., None]
    return self.o_proj(output.reshape(batch, length, -1))


def in_heads(queries, keys, values, batch, length, query_heads, kv_heads):
    """Projected q, k and v split into (B, L, H, D) heads, as mlx-lm's
    layers reshape them."""
    return (
        queries.reshape(batch, length, query_heads, -1),
        keys.reshape(batch, length, kv_heads, -1),
        values.reshape(batch, length, kv_heads, -1),
    )


def separate_projections(attention, x, batch, length, query_heads, kv_heads):
    """(B, L, H, D) queries, keys and values from ``q_proj``, ``k_proj``
    and ``v_proj``, split into heads."""
    return in_heads(
        attention.q_proj(x), attention.k_proj(x), attention.v_proj(x), batch, length,
        query_heads, kv_heads,
    )


@dataclasses.dataclass(frozen=True)
class PartNames:
    """How one family's attention names its parts."""

    heads: str  # the attribute with the query head count ("": not read)
    kv_heads: str  # the attribute with the key/value head count ("": not read)
    norms: Callable[[object], NormsRead] = _rms_norms()
    rope: Callable[[object], object] = rope_of()
    finish: Callable = projected()
    # (attention, x, B, L, query heads, kv heads) -> (B, L, H, D) queries,
    # keys and values, as the class's code projects and splits them.
    projections: Callable = separate_projections
    # (attention, queries, keys, values, cache, mask, B, L) -> attention's
    # output as (B, L, H * D), from what the cache update returned.
    attend: Callable = attended
    # Whether the class's __call__ takes ``mask`` without a default (a call
    # without it is then the TypeError the class's own code raises).
    mask_required: bool = False


# ---- The prework and the call ------------------------------------------------------


def _head_norm_for(query_norm, key_norm, mode) -> Optional[CompiledDualHeadNorm]:
    """The CompiledDualHeadNorm of a layer without RoPE (the one every
    norm pair of that eps shares, head_norms'), or None where its norms are
    not nn.RMSNorm with one plain eps."""
    if not _is_plain_norm(query_norm, key_norm):
        return None
    return head_norms.dual_norm_for(query_norm.eps, mode)


def _is_plain_norm(query_norm, key_norm) -> bool:
    if not (type(query_norm) is type(key_norm) is RMSNorm):
        return False
    eps = query_norm.eps
    return type(eps) in PLAIN_SCALAR_TYPES and type(key_norm.eps) is type(eps) and (
        key_norm.eps == eps
    )


def _normalized_heads(query_norm, key_norm, query_weight, key_weight, queries, keys, mode):
    """(B, H, L, D) queries and keys of a layer without RoPE, normalized by
    one call of the package, or None (the caller then runs the class's own
    __call__)."""
    try:
        head_norm = _head_norm_for(query_norm, key_norm, mode)
        if head_norm is None:
            return None
        queries, keys = head_norm(queries, keys, query_weight, key_weight)
        if STATE.prework_log is not None:  # a tool is recording
            note_prework(NORM_ONLY)
        return queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the full-attention norm", error)
        return None


def prework(part_names: PartNames, attention, mode, queries, keys, values, cache):
    """Queries, keys and values ready for attention, ``(B, H, L', D)``, the
    q/k prework one call of the package (norm + RoPE, with the cache write
    where the cache allows, or the norm alone in a layer without RoPE), or
    None (the caller then runs the class's own __call__). The package's
    objects are built in ``mode``."""
    try:
        norms = part_names.norms(attention)
        rope = None if norms is None else part_names.rope(attention)
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the full-attention norm (+ RoPE)", error)
        return None
    if norms is None:
        return None
    query_norm, key_norm, query_weight, key_weight = norms
    if rope is not None:  # with norms, or none (NO_NORMS: the RoPE alone)
        prework = norm_rope.LayerPrework(
            rope, query_norm, key_norm, query_weight, key_weight, mode
        )
        return cache_update.prework_and_cache_update(prework, queries, keys, values, cache)
    if query_norm is None:  # neither norms nor RoPE: nothing to compute
        return None
    normalized = _normalized_heads(
        query_norm, key_norm, query_weight, key_weight, queries, keys, mode
    )
    if normalized is None:
        return None
    normalized_queries, normalized_keys = normalized
    return cache_update.with_cache_update(normalized_queries, normalized_keys, values, cache)


def engages(part_names: PartNames, attention) -> bool:
    """Whether the layer's norms and RoPE are what :func:`prework` computes."""
    norms = part_names.norms(attention)
    if norms is None:
        return False
    rope = part_names.rope(attention)
    if rope is None:
        return norms is not NO_NORMS and _is_plain_norm(norms[0], norms[1])
    return is_plain_norm_rope(rope, norms[0], norms[1])


def _attention_call(part_names: PartNames):
    """The replacement __call__ of a family whose parts ``part_names`` names."""

    def call(self, mode, x, mask=None, cache=None):
        batch, length, _ = x.shape
        query_heads = getattr(self, part_names.heads) if part_names.heads else None
        kv_heads = getattr(self, part_names.kv_heads) if part_names.kv_heads else None
        head_queries, head_keys, head_values = part_names.projections(
            self, x, batch, length, query_heads, kv_heads
        )
        prepared = prework(
            part_names, self, mode, head_queries, head_keys, head_values, cache
        )
        if prepared is None:
            return original_call(self, x, mask, cache)
        output = part_names.attend(self, *prepared, cache, mask, batch, length)
        return part_names.finish(self, x, output, batch, length)

    if part_names.mask_required:

        def call_with_mask(self, mode, x, mask, cache=None):
            return call(self, mode, x, mask, cache)

        return call_with_mask
    return call


def attention_family(
    module: str, class_name: str, part_names: PartNames, refusal: Optional[str] = None
) -> AttentionFamily:
    """The family of ``module.class_name`` (an mlx-lm module), whose call is
    the projections, the prework and attention with the parts
    ``part_names`` names."""
    family = AttentionFamily(
        f"mlx_lm.models.{module}", class_name, _attention_call(part_names),
        lambda attention: engages(part_names, attention),
    )
    return family if refusal is None else dataclasses.replace(family, refusal=refusal)


_N_HEADS = PartNames("n_heads", "n_kv_heads")
_NUM_HEADS = PartNames("num_attention_heads", "num_key_value_heads")
_LFM2 = PartNames(
    "n_heads", "n_kv_heads", _rms_norms("q_layernorm", "k_layernorm"), finish=projected("out_proj")
)
_EXAONE = PartNames("n_heads", "n_kv_heads", rope=rope_of("use_rope"))

QWEN3_LIKE_FAMILIES = (
    attention_family("Klear", "KlearAttention", _NUM_HEADS),
    attention_family("dots1", "Dots1Attention", _N_HEADS),
    attention_family("lfm2", "Attention", _LFM2),
    attention_family("lfm2_moe", "Attention", _LFM2),
    attention_family("mellum", "Attention", _N_HEADS),
    attention_family("exaone4", "Attention", _EXAONE),
    attention_family("exaone_moe", "Attention", _EXAONE),
    attention_family("apertus", "ApertusAttention", _NUM_HEADS),
    attention_family(
        "glm4_moe", "Attention",
        PartNames("n_heads", "n_kv_heads", _rms_norms(flag="use_qk_norm")),
        "its norms or RoPE are not plain nn.RMSNorm / nn.RoPE",
    ),
    attention_family(
        "laguna", "Attention", PartNames("n_heads", "n_kv_heads", finish=_laguna_finish),
    ),
    attention_family(
        "step3p5", "Step3p5Attention",
        PartNames("num_heads", "num_kv_heads", _zero_centered_norms, finish=_step3p5_finish),
        "its norms are not ZeroCenteredRMSNorm of one eps, or its RoPE is not plain nn.RoPE",
    ),
    attention_family(
        "llama4_text", "Attention",
        PartNames("n_heads", "n_kv_heads", _weightless_norms, rope_of("use_rope")),
        "it has neither q/k norm nor RoPE, or its eps or RoPE are not plain",
    ),
)
register_attention_families(*QWEN3_LIKE_FAMILIES)

