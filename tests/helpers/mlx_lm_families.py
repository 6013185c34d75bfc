"""Small random models (config.json-style) of every mlx-lm family the patch
covers beside the package's own (``mlx_dualnorm.commands.shared.synthetic``),
with the layer kinds of each family's released checkpoints: those with
qwen3's q/k prework in other classes, one per model file of the other q/k
norm shapes, and at least one per registered class without q/k norms (the
RoPE-only call). The end of the file serves the package's catalogue API
(``build_synthetic_model``, ``synthetic_model_config``, ...) over both."""

from __future__ import annotations

import copy
import functools
from typing import Mapping, Optional, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dualnorm.commands.shared import synthetic
from mlx_dualnorm.commands.shared.synthetic import (  # the tests import these from here too
    DEFAULT_SEED, build_model, prompt_token_ids, randomize_norm_weights,
)

# Two layers of four query and two key/value heads: what every small
# attention model here starts from.
SMALL_ATTENTION_MODEL = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 1_000_000.0,
    "tie_word_embeddings": False,
}
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
    "beta_fast": 32.0, "beta_slow": 1.0,
}
_YARN_SCALING = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
_SLIDING_FULL = ["sliding_attention", "full_attention"]


def _config(base: Mapping[str, object], model_type: str, /, **changes: object) -> dict[str, object]:
    """A config.json-style dict: ``model_type`` first, then ``base`` with ``changes``."""
    return {"model_type": model_type, **base, **changes}


# ---- qwen3's q/k prework in other classes ----

_qwen3_like = functools.partial(_config, SMALL_ATTENTION_MODEL)
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
_LAGUNA = _qwen3_like(  # the two Laguna models differ only in their RoPE
    "laguna", **_EXPERTS, shared_expert_intermediate_size=32, sliding_window=8, gating=True,
    layer_types=["full_attention", "sliding_attention"],
)
_APERTUS = {  # lfm2, Klear and apertus derive the head width: hidden size / heads
    "model_type": "apertus",
    **{key: value for key, value in SMALL_ATTENTION_MODEL.items() if key != "head_dim"},
    "mlp_bias": False, "attention_bias": False, "post_norm": False, "qk_norm": True,
}

QWEN3_LIKE_CONFIGS: dict[str, dict[str, object]] = {
    "Klear": _qwen3_like(
        "Klear", **_EXPERTS, attention_bias=False, mlp_only_layers=[], decoder_sparse_step=1,
        n_shared_experts=1, norm_topk_prob=True,
    ),
    "dots1": _qwen3_like("dots1", **_GROUPED_EXPERTS),
    "lfm2": dict(
        model_type="lfm2", **_LFM2, block_dim=64, block_ff_dim=128, block_multiple_of=16,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
    ),
    "lfm2_moe": dict(
        model_type="lfm2_moe", **_LFM2, **_EXPERTS, intermediate_size=128, norm_topk_prob=True,
        use_expert_bias=True, num_dense_layers=1,
    ),
    "mellum": _qwen3_like(
        "mellum", **_EXPERTS, norm_topk_prob=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_theta": 10_000.0},
            "full_attention": {"rope_theta": 1_000_000.0},
        },
    ),
    "exaone4": _qwen3_like(
        "exaone4", rope_scaling=None, sliding_window=8,
        sliding_window_pattern="LG",  # the global layer has no RoPE
    ),
    "exaone_moe": _qwen3_like(
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
    "glm4_moe": _qwen3_like(
        "glm4_moe", **_GROUPED_EXPERTS, rope_scaling=None, use_qk_norm=True, attention_bias=True,
        partial_rotary_factor=0.5,
    ),
    "solar_open": _qwen3_like(
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
        "rope_scaling": {**_YARN_SCALING, "beta_fast": 32.0, "beta_slow": 1.0},
        "partial_rotary_factors": [0.5, 1.0], "use_head_wise_attn_gate": True,
        "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 32,
        "share_expert_dim": 32, "moe_layers_enum": "1",
    },
    "llama4_text": _qwen3_like(
        "llama4_text", intermediate_size_mlp=128,
        no_rope_layers=[1, 0],  # 1: the layer has RoPE
        use_qk_norm=True,
    ),
}

# name -> {parameter path: factor}, applied after initialization: lfm2's tied
# output head would outweigh what its random layers add.
QWEN3_LIKE_WEIGHT_SCALES = {
    "lfm2": {"model.embed_tokens.weight": 0.1},
    "lfm2_moe": {"model.embed_tokens.weight": 0.1},
}

# ---- the other q/k norm shapes, each keeping every kind of layer its file has ----

_SMALL = {
    key: value for key, value in SMALL_ATTENTION_MODEL.items()
    if key not in ("num_hidden_layers", "head_dim", "rope_theta")
}
_other_shape = functools.partial(_config, _SMALL)

ATTENTION_FAMILY_CONFIGS: dict[str, dict[str, object]] = {
    # ---- q/k norms after the transpose to (B, H, L, D) ----
    "afmoe": _other_shape(
        "afmoe", **_EXPERTS, head_dim=32, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_dense_layers=1, num_shared_experts=1, sliding_window=8,
    ),
    "openelm": dict(
        model_type="openelm", head_dim=16, num_transformer_layers=2, model_dim=64,
        vocab_size=512, ffn_dim_divisor=8, num_query_heads=[4, 4], num_kv_heads=[2, 1],
        ffn_multipliers=[1.0, 2.0], share_input_output_layers=False,
    ),
    "bailing_moe": _other_shape(
        "bailing_moe", **_EXPERTS, num_hidden_layers=2, num_shared_experts=1, norm_topk_prob=True,
        rope_theta=10_000.0, first_k_dense_replace=1, use_qk_norm=True, partial_rotary_factor=0.5,
    ),
    "bailing_moe_linear": _other_shape(
        "bailing_moe_linear", **_EXPERTS, num_hidden_layers=2, num_shared_experts=1,
        norm_topk_prob=True, rope_theta=10_000.0, first_k_dense_replace=1, use_qk_norm=True,
        layer_group_size=2, group_norm_size=2, partial_rotary_factor=0.5,
    ),
    "bailing_hybrid": _other_shape(
        "bailing_hybrid", **_EXPERTS, num_hidden_layers=2, num_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, layer_group_size=2, group_norm_size=2,
        rope_theta=10_000.0, routed_scaling_factor=1.0, head_dim=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    ),
    "gemma3_text": _other_shape(
        "gemma3_text", num_hidden_layers=2, head_dim=32, num_key_value_heads=1,
        query_pre_attn_scalar=32, sliding_window=8, sliding_window_pattern=2,
    ),
    "plamo3": _other_shape(
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
        "text_config": _other_shape(
            "gemma3n_text", num_hidden_layers=4, head_dim=32, num_key_value_heads=1,
            num_kv_shared_layers=2, vocab_size_per_layer_input=512, sliding_window=8,
            rope_local_base_freq=10_000.0, rope_theta=1_000_000.0, final_logit_softcapping=30.0,
            layer_types=_SLIDING_FULL * 2, activation_sparsity_pattern=[0.0] * 4,
            hidden_size_per_layer_input=16, altup_num_inputs=2, altup_coef_clip=120.0,
            altup_correct_scale=True, altup_active_idx=0, laurel_rank=8,
        ),
    },
    "gemma4_text": _other_shape(
        "gemma4_text", num_hidden_layers=6, head_dim=32, global_head_dim=64, num_key_value_heads=1,
        num_kv_shared_layers=2, vocab_size_per_layer_input=512, hidden_size_per_layer_input=16,
        sliding_window=8, final_logit_softcapping=30.0, layer_types=_SLIDING_FULL * 3,
        rope_parameters={
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
    ),
    "gear": _other_shape(
        "gear", num_hidden_layers=3, head_dim=16,
        layer_types=["sliding_attention", "full_attention", "conv_mixer"], sliding_window=8,
        attn_logit_softcapping=50.0,
    ),
    # ---- q/k norms over the whole H * D projection ----
    "olmo2": synthetic.synthetic_model_config("olmo2"),  # the package's own
    "olmo3": _other_shape(
        "olmo3", num_hidden_layers=2, sliding_window=8, rope_theta=10_000.0,
        layer_types=_SLIDING_FULL,
    ),
    "olmoe": _other_shape(
        "olmoe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, intermediate_size=32,
    ),
    "minimax": _other_shape(
        "minimax", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=32, intermediate_size=32, rope_theta=10_000.0, rotary_dim=16,
    ),
    "olmo_hybrid": _other_shape(
        "olmo_hybrid", num_hidden_layers=2, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=False, attention_bias=False,
        layer_types=["linear_attention", "full_attention"],
    ),
}

# ---- no q/k norms: the RoPE-only call ----

# Fields of many families (ModelArgs keep those they declare).
_ROPE_ONLY = {
    **SMALL_ATTENTION_MODEL, "head_dim": 32, "rms_norm_eps": 1e-5, "norm_eps": 1e-5,
    "rope_theta": 10_000.0, "attention_bias": False, "mlp_bias": False, "use_bias": False,
}
_rope_only = functools.partial(_config, _ROPE_ONLY)
_EITHER_EXPERTS = {  # under both names of the expert count
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

ROPE_ONLY_CONFIGS: dict[str, dict[str, object]] = {
    "llama": synthetic.synthetic_model_config("llama"),  # the package's own
    "llama-llama3": _rope_only("llama", rope_scaling=_LLAMA3),
    "qwen2": _rope_only("qwen2", rope_theta=1_000_000.0),
    "qwen2-yarn": _rope_only("qwen2", rope_scaling=_YARN_SCALING),
    "qwen2_moe": _rope_only("qwen2_moe", **_EITHER_EXPERTS, shared_expert_intermediate_size=64),
    "mixtral": _rope_only("mixtral", **_EITHER_EXPERTS),
    "gemma": _rope_only("gemma"),
    "deepseek": _rope_only(
        "deepseek", **_EITHER_EXPERTS, n_routed_experts=4, n_shared_experts=1,
        first_k_dense_replace=1,
    ),
    "ernie4_5": _rope_only("ernie4_5"),
    "ernie4_5_moe": _rope_only(
        "ernie4_5_moe", moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
    ),
    "glm": _rope_only("glm"),
    "glm4": _rope_only("glm4", partial_rotary_factor=0.5),
    "granite": _rope_only("granite", **_MULTIPLIERS),
    "granitemoe": _rope_only("granitemoe", **_MULTIPLIERS, **_EITHER_EXPERTS),
    "granitemoehybrid": _rope_only(
        "granitemoehybrid", **_MULTIPLIERS, **_EITHER_EXPERTS,
        layer_types=["attention", "attention"], position_embedding_type="rope",
        shared_intermediate_size=128,
    ),
    "helium": _rope_only("helium"),
    "internlm3": _rope_only("internlm3", bias=False, qkv_bias=False),
    "mimo": _rope_only("mimo"),
    "minicpm": _rope_only("minicpm", dim_model_base=64, scale_depth=1.4, scale_emb=4.0),
    "nanbeige": _rope_only("nanbeige"),
    "nemotron": _rope_only("nemotron", hidden_act="relu2", partial_rotary_factor=0.5),
    "phimoe": _rope_only(
        "phimoe", **_EITHER_EXPERTS, rope_scaling=_SU_SCALED, original_max_position_embeddings=1024,
    ),
    "seed_oss": _rope_only("seed_oss"),
    "starcoder2": _rope_only("starcoder2"),
    "telechat3": _rope_only("telechat3"),
    "falcon_h1": _rope_only(
        "falcon_h1", mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_chunk_size=4,
    ),
    "nemotron-nas": _rope_only(
        "nemotron-nas", hidden_act="silu",
        block_configs=[{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}}] * 2,
    ),
    "exaone": _rope_only("exaone", head_dim=16, num_layers=2, layer_norm_epsilon=1e-5),
    "phi3": _rope_only("phi3"),
    "internlm2": _rope_only("internlm2", bias=False),
    "dbrx": {
        "model_type": "dbrx", "vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4,
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10_000},
    },
    "qwen": _rope_only("qwen", kv_channels=16),
    "lille-130m": {
        "model_type": "lille-130m", "block_size": 512, "layer_norm_eps": 1e-5, "n_embd": 64,
        "n_head": 4, "n_kv_heads": 2, "n_layer": 2, "vocab_size": 512, "rope_theta": 10_000.0,
    },
    "gpt_oss": _rope_only(
        "gpt_oss", **_EITHER_EXPERTS, intermediate_size=64, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma2": _rope_only(
        "gemma2", query_pre_attn_scalar=32, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "cohere2": _rope_only(
        "cohere2", head_dim=16, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2,
        layer_norm_eps=1e-5,
    ),
    "cohere": _rope_only("cohere", layer_norm_eps=1e-5, use_qk_norm=False),
    "stablelm": _rope_only(
        "stablelm", layer_norm_eps=1e-5, partial_rotary_factor=0.5, use_qkv_bias=False,
        qk_layernorm=False,
    ),
    # Llama 4's query scale grows every original_max_position_embeddings
    # positions: 4, so that a few tokens see it change.
    "ministral3": _rope_only("ministral3", rope_parameters={
        **_YARN_SCALING, "rope_type": "yarn", "original_max_position_embeddings": 4,
        "rope_theta": 10_000.0, "llama_4_scaling_beta": 0.1, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    }),
}

# Mixture-of-experts families (MLX 0.32's CPU gather_mm takes float32 only)
# and falcon_h1 are float32, the others bfloat16.
FLOAT32_FAMILIES = frozenset({
    "Klear", "dots1", "lfm2_moe", "mellum", "exaone_moe", "glm4_moe", "solar_open", "laguna",
    "laguna-partial", "step3p5", "afmoe", "bailing_moe", "bailing_moe_linear", "bailing_hybrid",
    "minimax_m3_vl", "olmoe", "minimax", "qwen2_moe", "mixtral", "deepseek", "ernie4_5_moe",
    "granitemoe", "granitemoehybrid", "phimoe", "dbrx", "falcon_h1", "gpt_oss",
})


def _dtype_names(configs: Mapping[str, object]) -> dict[str, str]:
    return {name: "float32" if name in FLOAT32_FAMILIES else "bfloat16" for name in configs}


QWEN3_LIKE_DTYPE_NAMES = _dtype_names(QWEN3_LIKE_CONFIGS)
ROPE_ONLY_DTYPE_NAMES = _dtype_names(ROPE_ONLY_CONFIGS)


# ---- The package's catalogue API, over the families too ----

FAMILY_CONFIGS = {**QWEN3_LIKE_CONFIGS, **ATTENTION_FAMILY_CONFIGS, **ROPE_ONLY_CONFIGS}
SYNTHETIC_MODEL_TYPES = (
    *(name for name in synthetic.SYNTHETIC_MODEL_TYPES if name not in FAMILY_CONFIGS),
    *FAMILY_CONFIGS,
)
DEFAULT_DTYPES = {
    **synthetic.DEFAULT_DTYPES,
    **{name: getattr(mx, dtype_name) for name, dtype_name in _dtype_names(FAMILY_CONFIGS).items()
       if name not in synthetic.DEFAULT_DTYPES},
}


def synthetic_model_config(model_type: str) -> dict:
    """The config.json-style dict of a small model of the package or a family (a fresh copy)."""
    if model_type in synthetic.SYNTHETIC_MODEL_TYPES:
        return synthetic.synthetic_model_config(model_type)
    if model_type not in FAMILY_CONFIGS:
        raise ValueError(f"unknown synthetic model {model_type!r}; choose from "
                         f"{', '.join(SYNTHETIC_MODEL_TYPES)}")
    return copy.deepcopy(FAMILY_CONFIGS[model_type])


def build_synthetic_model(model_type: str, *, seed: int = DEFAULT_SEED,
                          dtype: Optional[mx.Dtype] = None) -> nn.Module:
    """The package's model of that name, or the family's: in ``dtype`` (None:
    ``DEFAULT_DTYPES``), its weight scales applied, the attention families'
    norm weights randomized."""
    if model_type in synthetic.SYNTHETIC_MODEL_TYPES:
        return synthetic.build_synthetic_model(model_type, seed=seed, dtype=dtype)
    dtype = DEFAULT_DTYPES[model_type] if dtype is None else dtype
    model = build_model(synthetic_model_config(model_type), seed=seed, dtype=dtype)
    scales = QWEN3_LIKE_WEIGHT_SCALES.get(model_type)
    if scales:
        weights = dict(cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())))
        model.update(tree_unflatten([
            (path, (weights[path] * factor).astype(weights[path].dtype))
            for path, factor in scales.items()
        ]))
        mx.eval(model.parameters())
    if model_type in ATTENTION_FAMILY_CONFIGS:
        randomize_norm_weights(model, seed)
    return model


def check_report(model_type: str, tokens: int) -> tuple[bool, str]:
    """What ``mlx-lm-check --synthetic MODEL_TYPE --rounds 1`` finds and prints, for a
    family of these tests too: whether it was identical, and the report."""
    from mlx_dualnorm.commands import mlx_lm_check

    prompt = mlx_lm_check.fixed_prompt(synthetic_model_config(model_type), 12)  # the CLI's
    result = mlx_lm_check.run_check(build_synthetic_model(model_type), prompt, tokens,
                                    timing_rounds=1)
    report = mlx_lm_check.format_result(result, f"synthetic {model_type}", int(prompt.size))
    return result.comparison.identical, report
