"""Small random models (config.json-style) of the mlx-lm families with qwen3's
q/k prework: two layers, hidden size 64, with the layer kinds of each family's
released checkpoints. Mixture-of-experts families are float32 (MLX 0.32's CPU
``gather_mm`` takes float32 only), the others bfloat16."""

from __future__ import annotations

# Two layers of four query and two key/value heads: what every small
# attention model here starts from.
SMALL_ATTENTION_MODEL = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
}
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_GROUPED_EXPERTS = {
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "first_k_dense_replace": 1,
}
_LFM2 = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "norm_eps": 1e-5, "vocab_size": 512,
    "max_position_embeddings": 4096, "conv_bias": False, "conv_L_cache": 3,
    "rope_theta": 1_000_000.0, "layer_types": ["conv", "full_attention"],
}
_YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
    "beta_fast": 32.0, "beta_slow": 1.0,
}


def _small(model_type: str, **changes: object) -> dict[str, object]:
    return {"model_type": model_type, **SMALL_ATTENTION_MODEL, **changes}


_LAGUNA = _small(  # the two Laguna models differ only in their RoPE
    "laguna", **_EXPERTS, shared_expert_intermediate_size=32, sliding_window=8, gating=True,
    layer_types=["full_attention", "sliding_attention"],
)
_APERTUS = {  # lfm2, Klear and apertus derive the head width: hidden size / heads
    "model_type": "apertus",
    **{key: value for key, value in SMALL_ATTENTION_MODEL.items() if key != "head_dim"},
    "mlp_bias": False, "attention_bias": False, "post_norm": False, "qk_norm": True,
}

QWEN3_LIKE_CONFIGS: dict[str, dict[str, object]] = {
    "Klear": _small(
        "Klear", **_EXPERTS, attention_bias=False, mlp_only_layers=[], decoder_sparse_step=1,
        n_shared_experts=1, norm_topk_prob=True,
    ),
    "dots1": _small("dots1", **_GROUPED_EXPERTS),
    "lfm2": dict(
        model_type="lfm2", **_LFM2, block_dim=64, block_ff_dim=128, block_multiple_of=16,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
    ),
    "lfm2_moe": dict(
        model_type="lfm2_moe", **_LFM2, **_EXPERTS, intermediate_size=128, norm_topk_prob=True,
        use_expert_bias=True, num_dense_layers=1,
    ),
    "mellum": _small(
        "mellum", **_EXPERTS, norm_topk_prob=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_theta": 10_000.0},
            "full_attention": {"rope_theta": 1_000_000.0},
        },
    ),
    "exaone4": _small(
        "exaone4", rope_scaling=None, sliding_window=8,
        sliding_window_pattern="LG",  # the global layer has no RoPE
    ),
    "exaone_moe": _small(
        "exaone_moe", **_EXPERTS, num_shared_experts=1, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],  # no RoPE on the full one
        is_moe_layer=[False, True],
    ),
    "apertus": _APERTUS,
    "apertus-llama3": {  # llama3's scaled RoPE (a frequency table) on every layer
        **_APERTUS,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        },
    },
    "glm4_moe": _small(
        "glm4_moe", **_GROUPED_EXPERTS, rope_scaling=None, use_qk_norm=True, attention_bias=True,
        partial_rotary_factor=0.5,
    ),
    "solar_open": _small(
        "solar_open", **_GROUPED_EXPERTS, use_qk_norm=True, partial_rotary_factor=0.5,
    ),
    "laguna": {
        **_LAGUNA,
        "rope_parameters": {  # as Laguna-XS: YaRN and partial rotary on full attention
            "full_attention": {"rope_theta": 500_000.0, "partial_rotary_factor": 0.5, **_YARN},
            "sliding_attention": {"rope_theta": 10_000.0},
        },
    },
    "laguna-partial": {
        **_LAGUNA,
        "rope_parameters": {
            "full_attention": {"rope_theta": 500_000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_theta": 10_000.0},
        },
    },
    "step3p5": {
        "model_type": "step3p5",
        **{key: value for key, value in SMALL_ATTENTION_MODEL.items()
           if key != "num_key_value_heads"},
        "num_attention_groups": 2, "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention"],
        "yarn_only_types": ["full_attention"],  # YaRN on the full-attention layer only
        "rope_scaling": {"type": "yarn", **{k: v for k, v in _YARN.items() if k != "rope_type"}},
        "partial_rotary_factors": [0.5, 1.0], "use_head_wise_attn_gate": True,
        "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 32,
        "share_expert_dim": 32, "moe_layers_enum": "1",
    },
    "llama4_text": _small(
        "llama4_text", intermediate_size_mlp=128,
        no_rope_layers=[1, 0],  # 1: the layer has RoPE
        use_qk_norm=True,
    ),
}

_FLOAT32 = ("Klear", "dots1", "lfm2_moe", "mellum", "exaone_moe", "glm4_moe", "solar_open",
            "laguna", "laguna-partial", "step3p5")
QWEN3_LIKE_DTYPE_NAMES = {
    name: "float32" if name in _FLOAT32 else "bfloat16" for name in QWEN3_LIKE_CONFIGS
}

# name -> {parameter path: factor}, applied after initialization: lfm2's tied
# output head would outweigh what its random layers add.
QWEN3_LIKE_WEIGHT_SCALES = {
    "lfm2": {"model.embed_tokens.weight": 0.1},
    "lfm2_moe": {"model.embed_tokens.weight": 0.1},
}
