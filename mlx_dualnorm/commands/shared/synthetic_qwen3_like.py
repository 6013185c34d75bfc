"""Small random models of the mlx-lm families whose attention has qwen3's
q/k prework (:mod:`mlx_dualnorm.integrations.mlx_lm.qwen3_like`).

Two decoder layers each, hidden size 64, vocabulary 512, head width 64
(``lfm2``, ``Klear`` and ``apertus`` derive it: hidden size / heads), so a
greedy run takes a moment on a CPU. Each config is config.json-style, with
the layer kinds of its family's released checkpoints where the family has
several: a layer without RoPE (``exaone4``, ``exaone_moe``,
``llama4_text``), partial rotary (``glm4_moe``, ``solar_open``,
``laguna``, ``step3p5``), a YaRN full-attention layer beside a
default-RoPE sliding one (``laguna``, ``step3p5``; both engage, the YaRN
layer with its frequency table), a convolution layer beside the attention
one (``lfm2``, ``lfm2_moe``). ``apertus-llama3`` has llama3's scaled RoPE
(a frequency table) on every layer.

lfm2's output head is its token embedding (tied, always): with mlx-lm's
random initialization each token's own embedding then outweighs what the
layers add, and greedy decoding repeats the last prompt token. Its
embedding is scaled by 0.1 after initialization (``QWEN3_LIKE_WEIGHT_SCALES``)
so that the layers decide the tokens.

Mixture-of-experts families are float32 (MLX 0.32's CPU ``gather_mm``
takes float32 only), the dense ones bfloat16. Nothing here imports MLX.
"""

from __future__ import annotations

__all__ = [
    "QWEN3_LIKE_CONFIGS", "QWEN3_LIKE_DTYPE_NAMES", "QWEN3_LIKE_WEIGHT_SCALES",
    "SMALL_ATTENTION_MODEL",
]

# Two layers of four query and two key/value heads: what every small
# attention model here starts from.
SMALL_ATTENTION_MODEL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
}
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_GROUPED_EXPERTS = {
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
}
_LFM2 = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "norm_eps": 1e-5,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "conv_bias": False,
    "conv_L_cache": 3,
    "rope_theta": 1_000_000.0,
    "layer_types": ["conv", "full_attention"],
}
_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
_LAGUNA = {  # the two Laguna models differ only in their RoPE
    "model_type": "laguna",
    **SMALL_ATTENTION_MODEL,
    **_EXPERTS,
    "shared_expert_intermediate_size": 32,
    "sliding_window": 8,
    "gating": True,
    "layer_types": ["full_attention", "sliding_attention"],
}

QWEN3_LIKE_CONFIGS: dict[str, dict[str, object]] = {
    "Klear": {
        "model_type": "Klear",
        **SMALL_ATTENTION_MODEL,
        **_EXPERTS,
        "attention_bias": False,
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
    },
    "dots1": {"model_type": "dots1", **SMALL_ATTENTION_MODEL, **_GROUPED_EXPERTS},
    "lfm2": {
        "model_type": "lfm2",
        **_LFM2,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
    },
    "lfm2_moe": {
        "model_type": "lfm2_moe",
        **_LFM2,
        **_EXPERTS,
        "intermediate_size": 128,
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "num_dense_layers": 1,
    },
    "mellum": {
        "model_type": "mellum",
        **SMALL_ATTENTION_MODEL,
        **_EXPERTS,
        "norm_topk_prob": True,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_theta": 10_000.0},
            "full_attention": {"rope_theta": 1_000_000.0},
        },
    },
    "exaone4": {
        "model_type": "exaone4",
        **SMALL_ATTENTION_MODEL,
        "rope_scaling": None,
        "sliding_window": 8,
        "sliding_window_pattern": "LG",  # the global layer has no RoPE
    },
    "exaone_moe": {
        "model_type": "exaone_moe",
        **SMALL_ATTENTION_MODEL,
        **_EXPERTS,
        "num_shared_experts": 1,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],  # no RoPE on the full one
        "is_moe_layer": [False, True],
    },
    "apertus": {
        "model_type": "apertus",
        **{key: value for key, value in SMALL_ATTENTION_MODEL.items() if key != "head_dim"},
        "mlp_bias": False,
        "attention_bias": False,
        "post_norm": False,
        "qk_norm": True,
    },
    "apertus-llama3": {
        "model_type": "apertus",
        **{key: value for key, value in SMALL_ATTENTION_MODEL.items() if key != "head_dim"},
        "mlp_bias": False,
        "attention_bias": False,
        "post_norm": False,
        "qk_norm": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 1024,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    },
    "glm4_moe": {
        "model_type": "glm4_moe",
        **SMALL_ATTENTION_MODEL,
        **_GROUPED_EXPERTS,
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
    "solar_open": {
        "model_type": "solar_open",
        **SMALL_ATTENTION_MODEL,
        **_GROUPED_EXPERTS,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
    },
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
        **{key: value for key, value in SMALL_ATTENTION_MODEL.items() if key != "num_key_value_heads"},
        "num_attention_groups": 2,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention"],
        "yarn_only_types": ["full_attention"],  # YaRN on the full-attention layer only
        "rope_scaling": {"type": "yarn", **{k: v for k, v in _YARN.items() if k != "rope_type"}},
        "partial_rotary_factors": [0.5, 1.0],
        "use_head_wise_attn_gate": True,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_intermediate_size": 32,
        "share_expert_dim": 32,
        "moe_layers_enum": "1",
    },
    "llama4_text": {
        "model_type": "llama4_text",
        **SMALL_ATTENTION_MODEL,
        "intermediate_size_mlp": 128,
        "no_rope_layers": [1, 0],  # 1: the layer has RoPE
        "use_qk_norm": True,
    },
}

_FLOAT32 = ("Klear", "dots1", "lfm2_moe", "mellum", "exaone_moe", "glm4_moe", "solar_open",
            "laguna", "laguna-partial", "step3p5")
QWEN3_LIKE_DTYPE_NAMES = {
    name: "float32" if name in _FLOAT32 else "bfloat16" for name in QWEN3_LIKE_CONFIGS
}

# name -> {parameter path: factor}, applied after initialization.
QWEN3_LIKE_WEIGHT_SCALES = {
    "lfm2": {"model.embed_tokens.weight": 0.1},
    "lfm2_moe": {"model.embed_tokens.weight": 0.1},
}
