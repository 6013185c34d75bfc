"""Small random models (config.json-style) of the mlx-lm families without q/k
norms (the RoPE-only call), at least one per registered class. ``_SMALL``
carries fields of many families (``ModelArgs`` keep those they declare)."""

from __future__ import annotations

from mlx_dualnorm.commands.shared.synthetic_qwen3_like import SMALL_ATTENTION_MODEL

_SMALL = {
    **SMALL_ATTENTION_MODEL, "head_dim": 32, "rms_norm_eps": 1e-5, "norm_eps": 1e-5,
    "rope_theta": 10_000.0, "attention_bias": False, "mlp_bias": False, "use_bias": False,
}
_EXPERTS = {
    "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
_MULTIPLIERS = {  # granite's muP scalings
    "logits_scaling": 2.0, "attention_multiplier": 0.125, "embedding_multiplier": 4.0,
    "residual_multiplier": 0.5,
}
_LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
_SU_SCALED = {  # phimoe's (required before mlx-lm 0.32): a su-scaled RoPE
    "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.2, 2.7],
    "long_factor": [1.0, 1.2, 1.5, 2.0, 2.6, 3.4, 4.4, 5.6],
    "short_mscale": 1.1, "long_mscale": 1.2,
}
_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def _family(model_type: str, **changes: object) -> dict[str, object]:
    return {"model_type": model_type, **_SMALL, **changes}


ROPE_ONLY_CONFIGS: dict[str, dict[str, object]] = {
    "llama": _family("llama"),
    "llama-llama3": _family("llama", rope_scaling=_LLAMA3),
    "qwen2": _family("qwen2", rope_theta=1_000_000.0),
    "qwen2-yarn": _family("qwen2", rope_scaling=_YARN),
    "qwen2_moe": _family("qwen2_moe", **_EXPERTS, shared_expert_intermediate_size=64),
    "mixtral": _family("mixtral", **_EXPERTS),
    "gemma": _family("gemma"),
    "deepseek": _family(
        "deepseek", **_EXPERTS, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1
    ),
    "ernie4_5": _family("ernie4_5"),
    "ernie4_5_moe": _family("ernie4_5_moe", moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
    "glm": _family("glm"),
    "glm4": _family("glm4", partial_rotary_factor=0.5),
    "granite": _family("granite", **_MULTIPLIERS),
    "granitemoe": _family("granitemoe", **_MULTIPLIERS, **_EXPERTS),
    "granitemoehybrid": _family(
        "granitemoehybrid", **_MULTIPLIERS, **_EXPERTS, layer_types=["attention", "attention"],
        position_embedding_type="rope", shared_intermediate_size=128,
    ),
    "helium": _family("helium"),
    "internlm3": _family("internlm3", bias=False, qkv_bias=False),
    "mimo": _family("mimo"),
    "minicpm": _family("minicpm", dim_model_base=64, scale_depth=1.4, scale_emb=4.0),
    "nanbeige": _family("nanbeige"),
    "nemotron": _family("nemotron", hidden_act="relu2", partial_rotary_factor=0.5),
    "phimoe": _family(
        "phimoe", **_EXPERTS, rope_scaling=_SU_SCALED, original_max_position_embeddings=1024
    ),
    "seed_oss": _family("seed_oss"),
    "starcoder2": _family("starcoder2"),
    "telechat3": _family("telechat3"),
    "falcon_h1": _family(
        "falcon_h1", mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_chunk_size=4,
    ),
    "nemotron-nas": _family(
        "nemotron-nas", hidden_act="silu",
        block_configs=[{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}}] * 2,
    ),
    "exaone": _family("exaone", head_dim=16, num_layers=2, layer_norm_epsilon=1e-5),
    "phi3": _family("phi3"),
    "internlm2": _family("internlm2", bias=False),
    "dbrx": {
        "model_type": "dbrx", "vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4,
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10_000},
    },
    "qwen": _family("qwen", kv_channels=16),
    "lille-130m": {
        "model_type": "lille-130m", "block_size": 512, "layer_norm_eps": 1e-5, "n_embd": 64,
        "n_head": 4, "n_kv_heads": 2, "n_layer": 2, "vocab_size": 512, "rope_theta": 10_000.0,
    },
    "gpt_oss": _family(
        "gpt_oss", **_EXPERTS, intermediate_size=64, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma2": _family(
        "gemma2", query_pre_attn_scalar=32, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "cohere2": _family(
        "cohere2", head_dim=16, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2,
        layer_norm_eps=1e-5,
    ),
    "cohere": _family("cohere", layer_norm_eps=1e-5, use_qk_norm=False),
    "stablelm": _family("stablelm", layer_norm_eps=1e-5, partial_rotary_factor=0.5,
                        use_qkv_bias=False, qk_layernorm=False),
    # Llama 4's query scale grows every original_max_position_embeddings
    # positions: 4, so that a few tokens see it change.
    "ministral3": _family("ministral3", rope_parameters={
        **_YARN, "rope_type": "yarn", "original_max_position_embeddings": 4,
        "rope_theta": 10_000.0, "llama_4_scaling_beta": 0.1, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    }),
}

_FLOAT32 = ("qwen2_moe", "mixtral", "deepseek", "ernie4_5_moe", "granitemoe", "granitemoehybrid",
            "phimoe", "dbrx", "falcon_h1", "gpt_oss")
ROPE_ONLY_DTYPE_NAMES = {
    name: "float32" if name in _FLOAT32 else "bfloat16" for name in ROPE_ONLY_CONFIGS
}

# Llama 3.2 1B's dimensions, its RoPE scaling left out (plain RoPE): the
# decode model of this shape (synthetic.DECODE_MODELS).
LLAMA_2048 = {
    "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
    "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500_000.0, "tie_word_embeddings": True,
}
