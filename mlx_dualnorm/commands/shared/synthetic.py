"""Small random mlx-lm models (mlx-lm's own classes, a config.json-style dict,
weights from a fixed seed; nothing downloaded), one of each kind of work the
patch replaces: ``qwen3_next`` and ``qwen3_5`` have Qwen3-Next's gated-delta
and full-attention heads, ``qwen3`` and ``qwen3_moe`` Qwen3's q/k norms + RoPE,
``olmo2`` q/k norms over the whole projection, ``llama`` no q/k norms (RoPE
and the cache write alone). The tests hold one of every covered family.
``DECODE_MODELS``: released checkpoints' dimensions, for timing whole decode
tokens."""

from __future__ import annotations

import copy
import dataclasses
import importlib
from typing import Optional, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

DEFAULT_SEED = 20261129
NORM_WEIGHT_SPREAD = 0.5

GATED_DELTA_HEADS = {
    "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}
SMALL_DECODER = {
    "hidden_size": 64, "num_hidden_layers": 4, "full_attention_interval": 4,
    "intermediate_size": 128, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
_MOE = {
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "moe_intermediate_size": 32,
}
_QWEN3 = {
    **{key: value for key, value in SMALL_DECODER.items() if key != "full_attention_interval"},
    "num_hidden_layers": 2, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1_000_000.0,
}

_CONFIGS: dict[str, dict[str, object]] = {
    "qwen3_next": {
        "model_type": "qwen3_next", **SMALL_DECODER, **GATED_DELTA_HEADS,
        "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, **_MOE,
        "shared_expert_intermediate_size": 64, "mlp_only_layers": [], "norm_topk_prob": True,
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text", **SMALL_DECODER, **GATED_DELTA_HEADS, "num_experts": 0,
        },
    },
    "qwen3": {"model_type": "qwen3", **_QWEN3},
    "qwen3_moe": {
        "model_type": "qwen3_moe", **_QWEN3, **_MOE, "mlp_only_layers": [], "norm_topk_prob": True,
    },
    "olmo2": {
        "model_type": "olmo2", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "num_hidden_layers": 2,
    },
    "llama": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
        "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 10_000.0,
        "tie_word_embeddings": False, "norm_eps": 1e-5, "attention_bias": False,
        "mlp_bias": False, "use_bias": False,
    },
}
DEFAULT_DTYPES = {
    name: mx.float32 if name in ("qwen3_next", "qwen3_moe") else mx.bfloat16 for name in _CONFIGS
}
# Whose norm weights are randomized: its q/k norms are not qwen3's.
RANDOMIZED_NORMS = frozenset({"olmo2"})
SYNTHETIC_MODEL_TYPES = tuple(_CONFIGS)


def synthetic_model_config(model_type: str) -> dict:
    """The config.json-style dict of a synthetic model (a fresh copy)."""
    if model_type not in _CONFIGS:
        choices = ", ".join(SYNTHETIC_MODEL_TYPES)
        raise ValueError(f"unknown synthetic model {model_type!r}; choose from {choices}")
    return copy.deepcopy(_CONFIGS[model_type])


def build_synthetic_model(model_type: str, *, seed: int = DEFAULT_SEED,
                          dtype: Optional[mx.Dtype] = None) -> nn.Module:
    """:func:`build_model` of ``model_type`` in ``dtype`` (None: ``DEFAULT_DTYPES``), the
    norm weights of ``RANDOMIZED_NORMS`` randomized."""
    dtype = DEFAULT_DTYPES[model_type] if dtype is None else dtype
    model = build_model(synthetic_model_config(model_type), seed=seed, dtype=dtype)
    if model_type in RANDOMIZED_NORMS:
        randomize_norm_weights(model, seed)
    return model


def build_model(config: dict, *, seed: int = DEFAULT_SEED, dtype: mx.Dtype) -> nn.Module:
    """mlx-lm's model of ``config`` after ``mx.random.seed(seed)`` (MLX's global generator),
    floating weights cast to ``dtype`` where its ``cast_predicate`` allows, in eval mode."""
    architecture = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = architecture.Model(architecture.ModelArgs.from_dict(config))
    should_cast = getattr(model, "cast_predicate", None) or (lambda path: True)
    # Without a destination, tree_flatten returns (path, value) pairs.
    weights = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    model.update(tree_unflatten([
        (path, value.astype(dtype))
        for path, value in weights
        if mx.issubdtype(value.dtype, mx.floating) and should_cast(path)
    ]))
    mx.eval(model.parameters())
    model.eval()
    return model


def randomize_norm_weights(model: nn.Module, seed: int) -> None:
    """Adds ``NORM_WEIGHT_SPREAD`` times a normal draw to every ``*norm*...weight``
    parameter: with all-ones weights a lost norm weight would not show."""
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


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """A random model at a released checkpoint's dimensions."""

    name: str
    resembles: str  # the released model whose dimensions it has
    config: dict  # config.json-style, at full size
    quick_layers: int  # the fewest layers that keep every kind of layer


def _qwen3_dense(hidden_size: int, intermediate_size: int) -> dict:
    return dict(
        model_type="qwen3", hidden_size=hidden_size, num_hidden_layers=28,
        intermediate_size=intermediate_size, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-6, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1_000_000.0, tie_word_embeddings=True,
    )


# glm4_moe-5120 and qwen3_next-2048 have a dense MLP in place of their
# mixture of experts: about the matmul work per token of the active experts
# plus the shared one, without the expert weights.
DECODE_MODELS = {
    model.name: model
    for model in (
        DecodeModel("qwen3-1024", "Qwen3-0.6B", _qwen3_dense(1024, 3072), quick_layers=2),
        DecodeModel("qwen3-2048", "Qwen3-1.7B", _qwen3_dense(2048, 6144), quick_layers=2),
        DecodeModel(
            "llama-2048", "Llama 3.2 1B (its RoPE scaling left out: plain RoPE)", quick_layers=2,
            config=dict(
                model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                vocab_size=128256, max_position_embeddings=131072, rope_theta=500_000.0,
                tie_word_embeddings=True,
            ),
        ),
        DecodeModel(
            "gemma3-1152", "Gemma 3 1B", quick_layers=6,  # five sliding-window layers, one global
            config=dict(  # mlx-lm's gemma3_text defaults are Gemma 3 1B's config.
                model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26,
                intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                rms_norm_eps=1e-6, vocab_size=262144, rope_theta=1_000_000.0,
                rope_local_base_freq=10_000.0, query_pre_attn_scalar=256, sliding_window=512,
                sliding_window_pattern=6, max_position_embeddings=32768,
            ),
        ),
        DecodeModel(
            "olmo2-2048", "OLMo 2 1B", quick_layers=2,
            config=dict(  # its q/k norms span all heads
                model_type="olmo2", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                num_attention_heads=16, num_key_value_heads=16, head_dim=128, rms_norm_eps=1e-6,
                vocab_size=100352, max_position_embeddings=4096, rope_theta=500_000.0,
                tie_word_embeddings=False,
            ),
        ),
        DecodeModel(
            "glm4_moe-5120", "GLM-4.5 (355B-A32B), 16 of its 92 layers, dense MLP", quick_layers=2,
            config=dict(
                model_type="glm4_moe", hidden_size=5120, num_hidden_layers=16,
                # Every layer takes the dense MLP of GLM-4.5's first three layers
                # (about the work of its 8 active experts of 1536 and the shared one).
                first_k_dense_replace=16, intermediate_size=12288, moe_intermediate_size=1536,
                n_routed_experts=160, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
                topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                num_attention_heads=96, num_key_value_heads=8, head_dim=128, use_qk_norm=True,
                partial_rotary_factor=0.5, attention_bias=True, rms_norm_eps=1e-5,
                rope_theta=1_000_000.0, rope_scaling=None, vocab_size=151552,
                max_position_embeddings=131072, tie_word_embeddings=False,
            ),
        ),
        DecodeModel(
            "qwen3_next-2048", "Qwen3-Next-80B-A3B, 24 of its 48 layers, dense MLP",
            quick_layers=4,  # three gated-delta layers and one full-attention
            config={
                **_CONFIGS["qwen3_next"], "hidden_size": 2048, "num_hidden_layers": 24,
                "intermediate_size": 5120, "vocab_size": 151936,
                "num_experts": 0, "num_experts_per_tok": 0,  # every layer takes the dense MLP
            },
        ),
    )
}


def decode_model_config(name: str, *, layers: Optional[int] = None,
                        vocab_size: Optional[int] = None) -> dict:
    """A copy of ``DECODE_MODELS[name]``'s config, ``layers`` and ``vocab_size`` as given."""
    if name not in DECODE_MODELS:
        raise ValueError(f"unknown decode model {name!r}; choose from {', '.join(DECODE_MODELS)}")
    config = copy.deepcopy(DECODE_MODELS[name].config)
    if layers is not None:
        config["num_hidden_layers"] = layers
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    return config


def prompt_token_ids(vocab_size: int, length: int = 12) -> mx.array:
    """A fixed prompt of ``length`` distinct-looking token ids below ``vocab_size``."""
    if length < 1 or vocab_size < 2:
        raise ValueError("a prompt needs length >= 1 and a vocabulary of >= 2 tokens")
    return mx.array([(37 * position + 11) % vocab_size for position in range(length)])
