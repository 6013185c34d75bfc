"""Tiny mlx-lm models (config.json-style) of the attention families outside
the qwen3 shape, one per model file whose q/k norms the patch makes one call,
keeping every kind of layer the file has. Norm weights are drawn around their
initial value: with all-ones weights a lost norm weight would not show."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dualnorm.commands.shared.synthetic_qwen3_like import SMALL_ATTENTION_MODEL

NORM_WEIGHT_SPREAD = 0.5

_SMALL = {
    key: value for key, value in SMALL_ATTENTION_MODEL.items()
    if key not in ("num_hidden_layers", "head_dim", "rope_theta")
}
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_SLIDING_FULL = ["sliding_attention", "full_attention"]


def _family(model_type: str, **changes: object) -> dict[str, object]:
    return {"model_type": model_type, **_SMALL, **changes}


ATTENTION_FAMILY_CONFIGS: dict[str, dict[str, object]] = {
    # ---- q/k norms after the transpose to (B, H, L, D) ----
    "afmoe": _family(
        "afmoe", **_EXPERTS, head_dim=32, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_dense_layers=1, num_shared_experts=1, sliding_window=8,
    ),
    "openelm": dict(
        model_type="openelm", head_dim=16, num_transformer_layers=2, model_dim=64,
        vocab_size=512, ffn_dim_divisor=8, num_query_heads=[4, 4], num_kv_heads=[2, 1],
        ffn_multipliers=[1.0, 2.0], share_input_output_layers=False,
    ),
    "bailing_moe": _family(
        "bailing_moe", **_EXPERTS, num_hidden_layers=2, num_shared_experts=1,
        norm_topk_prob=True, rope_theta=10_000.0, first_k_dense_replace=1, use_qk_norm=True,
        partial_rotary_factor=0.5,
    ),
    "bailing_moe_linear": _family(
        "bailing_moe_linear", **_EXPERTS, num_hidden_layers=2, num_shared_experts=1,
        norm_topk_prob=True, rope_theta=10_000.0, first_k_dense_replace=1, use_qk_norm=True,
        layer_group_size=2, group_norm_size=2, partial_rotary_factor=0.5,
    ),
    "bailing_hybrid": _family(
        "bailing_hybrid", **_EXPERTS, num_hidden_layers=2, num_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, layer_group_size=2, group_norm_size=2,
        rope_theta=10_000.0, routed_scaling_factor=1.0, head_dim=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    ),
    "gemma3_text": _family(
        "gemma3_text", num_hidden_layers=2, head_dim=32, num_key_value_heads=1,
        query_pre_attn_scalar=32, sliding_window=8, sliding_window_pattern=2,
    ),
    "plamo3": _family(
        "plamo3", num_hidden_layers=2, head_dim=16, sliding_window_pattern=2, window_size=8,
        tie_word_embeddings=True,
    ),
    "minimax_m3_vl": {
        "model_type": "minimax_m3_vl",
        "text_config": dict(
            _SMALL, intermediate_size=32, dense_intermediate_size=128,
            shared_intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
            num_experts_per_tok=2, head_dim=16, rotary_dim=8, mlp_layer_types=["dense", "sparse"],
            layer_types=["full_attention", "sparse_attention"], index_n_heads=2,
            index_head_dim=16, index_block_size=4, index_topk_blocks=2,
        ),
    },
    # ---- q/k norms per head before the transpose ----
    "gemma3n": {
        "model_type": "gemma3n",
        "text_config": _family(
            "gemma3n_text", num_hidden_layers=4, head_dim=32, num_key_value_heads=1,
            num_kv_shared_layers=2, vocab_size_per_layer_input=512, sliding_window=8,
            rope_local_base_freq=10_000.0, rope_theta=1_000_000.0, final_logit_softcapping=30.0,
            layer_types=_SLIDING_FULL * 2, activation_sparsity_pattern=[0.0] * 4,
            hidden_size_per_layer_input=16, altup_num_inputs=2, altup_coef_clip=120.0,
            altup_correct_scale=True, altup_active_idx=0, laurel_rank=8,
        ),
    },
    "gemma4_text": _family(
        "gemma4_text", num_hidden_layers=6, head_dim=32, global_head_dim=64,
        num_key_value_heads=1, num_kv_shared_layers=2, vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=16, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=_SLIDING_FULL * 3,
        rope_parameters={
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
    ),
    "gear": _family(
        "gear", num_hidden_layers=3, head_dim=16,
        layer_types=["sliding_attention", "full_attention", "conv_mixer"], sliding_window=8,
        attn_logit_softcapping=50.0,
    ),
    # ---- q/k norms over the whole H * D projection ----
    "olmo2": _family("olmo2", num_hidden_layers=2),
    "olmo3": _family(
        "olmo3", num_hidden_layers=2, sliding_window=8, rope_theta=10_000.0,
        layer_types=_SLIDING_FULL,
    ),
    "olmoe": _family(
        "olmoe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, intermediate_size=32,
    ),
    "minimax": _family(
        "minimax", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=32, intermediate_size=32, rope_theta=10_000.0, rotary_dim=16,
    ),
    "olmo_hybrid": _family(
        "olmo_hybrid", num_hidden_layers=2, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=False, attention_bias=False,
        layer_types=["linear_attention", "full_attention"],
    ),
}

_WITH_EXPERTS = {
    "afmoe", "bailing_moe", "bailing_moe_linear", "bailing_hybrid", "minimax_m3_vl", "olmoe",
    "minimax",
}
ATTENTION_FAMILY_DTYPE_NAMES = {
    name: "float32" if name in _WITH_EXPERTS else "bfloat16" for name in ATTENTION_FAMILY_CONFIGS
}


def randomize_norm_weights(model: nn.Module, seed: int) -> None:
    """Adds ``NORM_WEIGHT_SPREAD`` times a normal draw (from ``seed``) to every
    ``*norm*...weight`` parameter of ``model``, in its dtype."""
    key = mx.random.key(seed)
    weights = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    updated = []
    for path, value in weights:
        if "norm" in path.lower() and path.endswith(".weight"):
            key, draw = mx.random.split(key)
            noise = NORM_WEIGHT_SPREAD * mx.random.normal(value.shape, key=draw)
            updated.append((path, (value.astype(mx.float32) + noise).astype(value.dtype)))
    model.update(tree_unflatten(updated))
    mx.eval(model.parameters())
