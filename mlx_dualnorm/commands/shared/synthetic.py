"""Small random mlx-lm models with the head shapes of released models.

Built from mlx-lm's own model classes (``mlx_lm.models.qwen3_next``,
``mlx_lm.models.qwen3_5``, ``qwen3``, ``qwen3_moe``, ...) and a config
dict like a checkpoint's config.json, with random weights from a fixed
seed: nothing is downloaded. The gated-delta models are tiny (hidden size
64, vocabulary 512, four layers: three gated-delta and one
full-attention), but their gated-delta layers have the
real head counts of Qwen3-Next: 16 key heads of width 128 and 32 value
heads of width 128, so each token normalizes q and k of shape
``(1, 1, 16, 128)``, as the 80B model does; their full-attention layer has
the real head_dim 256 with 16 query and 2 key/value heads.

``qwen3`` and ``qwen3_moe`` (mlx-lm's dense and mixture-of-experts Qwen3)
have two full-attention layers with Qwen3's head counts: 16 query and 8
key/value heads of width 128; ``qwen3`` is bfloat16, ``qwen3_moe`` float32.

``qwen3_next`` has a mixture-of-experts MLP and is built in float32 by
default (MLX 0.32's CPU gather_mm, which the experts use, takes float32
only); ``qwen3_5`` has a dense MLP, mlx-lm's text_config nesting, and is
built in bfloat16, the dtype of the released checkpoints. Floating weights
are cast to the dtype except where the model's own ``cast_predicate``
keeps them (``A_log`` stays float32, as in checkpoints).

``DECODE_MODELS`` are random models at the dimensions of released
checkpoints, for timing whole decode tokens where the q/k prework is the
share of a token it is in practice: ``qwen3-1024`` (Qwen3-0.6B's
dimensions), ``qwen3-2048`` (Qwen3-1.7B's), ``gemma3-1152`` (Gemma 3
1B's, mlx-lm's ``gemma3_text``: five sliding-window layers to one global),
``olmo2-2048`` (OLMo 2 1B's, whose q/k norms span all heads),
``glm4_moe-5120`` (16 of GLM-4.5's 92 layers, with its q/k norms and half
the head width rotated) and ``qwen3_next-2048`` (24 layers of
Qwen3-Next-80B's dimensions, one full-attention layer in four). The last
two have a dense MLP in place of their mixture of experts (GLM-4.5's own
dense-layer ``intermediate_size``, 12288; Qwen3-Next's 5120): about the
matmul work per token of the active experts plus the shared one, without
the expert weights. All are built in bfloat16. ``decode_model_config`` can shrink layer
count and vocabulary (quick runs, tests) while keeping the per-layer shapes.

:mod:`~mlx_dualnorm.commands.shared.synthetic_qwen3_like` adds small models of
the families whose attention has qwen3's q/k prework under other names
(``Klear``, ``dots1``, ``lfm2``, ``exaone4``, ``llama4_text``, ...).

The attention families outside the qwen3 shape have a tiny model each,
named by its mlx-lm file (``afmoe`` ... ``olmo_hybrid``), from
:mod:`~mlx_dualnorm.commands.shared.synthetic_attention`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from typing import Optional, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dualnorm.commands.shared.synthetic_attention import (
    ATTENTION_FAMILY_CONFIGS,
    ATTENTION_FAMILY_DTYPES,
    randomize_norm_weights,
)
from mlx_dualnorm.commands.shared.synthetic_qwen3_like import (
    QWEN3_LIKE_CONFIGS,
    QWEN3_LIKE_DTYPE_NAMES,
    QWEN3_LIKE_WEIGHT_SCALES,
)
from mlx_dualnorm.commands.shared.synthetic_rope_only import (
    LLAMA_2048,
    ROPE_ONLY_CONFIGS,
    ROPE_ONLY_DTYPE_NAMES,
)

__all__ = [
    "DEFAULT_DTYPES", "DEFAULT_SEED", "GATED_DELTA_MODEL_TYPES", "DECODE_MODELS",
    "DecodeModel", "build_model", "SYNTHETIC_MODEL_TYPES", "build_synthetic_model",
    "decode_model_config", "prompt_token_ids", "synthetic_model_config",
]

DEFAULT_SEED = 20261129

GATED_DELTA_HEADS = {
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}

SMALL_DECODER = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "intermediate_size": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

_CONFIGS: dict[str, dict[str, object]] = {
    "qwen3_next": {
        "model_type": "qwen3_next",
        **SMALL_DECODER,
        **GATED_DELTA_HEADS,
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            **SMALL_DECODER,
            **GATED_DELTA_HEADS,
            "num_experts": 0,
        },
    },
}

DEFAULT_DTYPES = {"qwen3_next": mx.float32, "qwen3_5": mx.bfloat16}
# The models with gated-delta layers (mlx-lm-bench's default).
GATED_DELTA_MODEL_TYPES = tuple(_CONFIGS)

# mlx-lm's qwen3 (dense) and qwen3_moe: full attention only, two layers
# with the head counts of Qwen3-0.6B and -1.7B (16 query heads and 8
# key/value heads of width 128), so each layer's norm + RoPE runs at the
# released shapes.
_QWEN3 = {
    **{key: value for key, value in SMALL_DECODER.items() if key != "full_attention_interval"},
    "num_hidden_layers": 2,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1_000_000.0,
}
_CONFIGS["qwen3"] = {"model_type": "qwen3", **_QWEN3}
_CONFIGS["qwen3_moe"] = {
    "model_type": "qwen3_moe",
    **_QWEN3,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 32,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}
DEFAULT_DTYPES.update({"qwen3": mx.bfloat16, "qwen3_moe": mx.float32})

# The families with qwen3's q/k prework in other attention classes.
_CONFIGS.update(QWEN3_LIKE_CONFIGS)
DEFAULT_DTYPES.update(
    {name: getattr(mx, dtype_name) for name, dtype_name in QWEN3_LIKE_DTYPE_NAMES.items()}
)
# name -> {parameter path: factor} applied after initialization, where
# mlx-lm's random weights would make a degenerate model.
_WEIGHT_SCALES: dict[str, dict[str, float]] = dict(QWEN3_LIKE_WEIGHT_SCALES)

# The attention families outside the qwen3 shape (their own module).
_CONFIGS.update(ATTENTION_FAMILY_CONFIGS)
DEFAULT_DTYPES.update(ATTENTION_FAMILY_DTYPES)
# The families without q/k norms (their own module).
_CONFIGS.update(ROPE_ONLY_CONFIGS)
DEFAULT_DTYPES.update(
    {name: getattr(mx, dtype_name) for name, dtype_name in ROPE_ONLY_DTYPE_NAMES.items()}
)

SYNTHETIC_MODEL_TYPES = tuple(_CONFIGS)


def synthetic_model_config(model_type: str) -> dict:
    """The config.json-style dict of a synthetic model (a fresh copy)."""
    if model_type not in _CONFIGS:
        raise ValueError(
            f"unknown synthetic model {model_type!r}; choose from "
            f"{', '.join(SYNTHETIC_MODEL_TYPES)}"
        )
    return copy.deepcopy(_CONFIGS[model_type])


def build_synthetic_model(
    model_type: str, *, seed: int = DEFAULT_SEED, dtype: Optional[mx.Dtype] = None
) -> nn.Module:
    """mlx-lm's model class for ``model_type`` with mlx-lm's own random
    initialization drawn after ``mx.random.seed(seed)`` (this reseeds MLX's
    global generator), cast to ``dtype`` (None: the model's default in
    ``DEFAULT_DTYPES``), in eval mode, evaluated; the few weights a
    degenerate random model would need changed are scaled after that
    (``_WEIGHT_SCALES``), and the attention families' norm weights drawn
    around their initial value (``randomize_norm_weights``)."""
    dtype = DEFAULT_DTYPES[model_type] if dtype is None else dtype
    model = build_model(synthetic_model_config(model_type), seed=seed, dtype=dtype)
    scales = _WEIGHT_SCALES.get(model_type)
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


def build_model(config: dict, *, seed: int = DEFAULT_SEED, dtype: mx.Dtype) -> nn.Module:
    """mlx-lm's model class for ``config["model_type"]``, randomly
    initialized after ``mx.random.seed(seed)``, cast to ``dtype``, in eval
    mode, evaluated."""
    architecture = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = architecture.Model(architecture.ModelArgs.from_dict(config))
    _cast_floating_weights(model, dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """A random model at a released checkpoint's dimensions."""

    name: str
    resembles: str  # the released model whose dimensions it has
    config: dict  # config.json-style, at full size
    quick_layers: int  # the fewest layers that keep every kind of layer


def _qwen3_dense(hidden_size: int, intermediate_size: int) -> dict:
    return {
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "num_hidden_layers": 28,
        "intermediate_size": intermediate_size,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    }


DECODE_MODELS = {
    model.name: model
    for model in (
        DecodeModel("qwen3-1024", "Qwen3-0.6B", _qwen3_dense(1024, 3072), quick_layers=2),
        DecodeModel("qwen3-2048", "Qwen3-1.7B", _qwen3_dense(2048, 6144), quick_layers=2),
        DecodeModel(
            "llama-2048",
            "Llama 3.2 1B (its RoPE scaling left out: plain RoPE)",
            LLAMA_2048,
            quick_layers=2,
        ),
        DecodeModel(
            "gemma3-1152",
            "Gemma 3 1B",
            {
                # mlx-lm's gemma3_text defaults are Gemma 3 1B's config.
                "model_type": "gemma3_text",
                "hidden_size": 1152,
                "num_hidden_layers": 26,
                "intermediate_size": 6912,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 256,
                "rms_norm_eps": 1e-6,
                "vocab_size": 262144,
                "rope_theta": 1_000_000.0,
                "rope_local_base_freq": 10_000.0,
                "query_pre_attn_scalar": 256,
                "sliding_window": 512,
                "sliding_window_pattern": 6,
                "max_position_embeddings": 32768,
            },
            quick_layers=6,  # five sliding-window layers and one global
        ),
        DecodeModel(
            "olmo2-2048",
            "OLMo 2 1B",
            {
                "model_type": "olmo2",
                "hidden_size": 2048,
                "num_hidden_layers": 16,
                "intermediate_size": 8192,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "head_dim": 128,
                "rms_norm_eps": 1e-6,
                "vocab_size": 100352,
                "max_position_embeddings": 4096,
                "rope_theta": 500_000.0,
                "tie_word_embeddings": False,
            },
            quick_layers=2,
        ),
        DecodeModel(
            "glm4_moe-5120",
            "GLM-4.5 (355B-A32B), 16 of its 92 layers, dense MLP",
            {
                "model_type": "glm4_moe",
                "hidden_size": 5120,
                "num_hidden_layers": 16,
                # Every layer takes the dense MLP of GLM-4.5's first three
                # layers: about the matmul work of its 8 active experts of
                # 1536 and the shared one, without 160 experts per layer.
                "first_k_dense_replace": 16,
                "intermediate_size": 12288,
                "moe_intermediate_size": 1536,
                "n_routed_experts": 160,
                "num_experts_per_tok": 8,
                "n_shared_experts": 1,
                "n_group": 1,
                "topk_group": 1,
                "norm_topk_prob": True,
                "routed_scaling_factor": 2.5,
                "num_attention_heads": 96,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "use_qk_norm": True,
                "partial_rotary_factor": 0.5,
                "attention_bias": True,
                "rms_norm_eps": 1e-5,
                "rope_theta": 1_000_000.0,
                "rope_scaling": None,
                "vocab_size": 151552,
                "max_position_embeddings": 131072,
                "tie_word_embeddings": False,
            },
            quick_layers=2,
        ),
        DecodeModel(
            "qwen3_next-2048",
            "Qwen3-Next-80B-A3B, 24 of its 48 layers, dense MLP",
            {
                **_CONFIGS["qwen3_next"],
                "hidden_size": 2048,
                "num_hidden_layers": 24,
                "intermediate_size": 5120,
                "vocab_size": 151936,
                "num_experts": 0,  # every layer takes the dense MLP
                "num_experts_per_tok": 0,
            },
            quick_layers=4,  # three gated-delta layers and one full-attention
        ),
    )
}


def decode_model_config(
    name: str, *, layers: Optional[int] = None, vocab_size: Optional[int] = None
) -> dict:
    """The config of ``DECODE_MODELS[name]`` (a fresh copy), with
    ``layers`` decoder layers and a vocabulary of ``vocab_size`` where given."""
    if name not in DECODE_MODELS:
        raise ValueError(
            f"unknown decode model {name!r}; choose from {', '.join(DECODE_MODELS)}"
        )
    config = copy.deepcopy(DECODE_MODELS[name].config)
    if layers is not None:
        config["num_hidden_layers"] = layers
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    return config


def _cast_floating_weights(model: nn.Module, dtype: mx.Dtype) -> None:
    should_cast = getattr(model, "cast_predicate", None) or (lambda path: True)
    # Without a destination, tree_flatten returns (path, value) pairs.
    weights = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    cast_weights = [
        (path, value.astype(dtype))
        for path, value in weights
        if mx.issubdtype(value.dtype, mx.floating) and should_cast(path)
    ]
    model.update(tree_unflatten(cast_weights))


def prompt_token_ids(vocab_size: int, length: int = 12) -> mx.array:
    """A fixed prompt of ``length`` distinct-looking token ids below
    ``vocab_size``."""
    if length < 1 or vocab_size < 2:
        raise ValueError("a prompt needs length >= 1 and a vocabulary of >= 2 tokens")
    return mx.array([(37 * position + 11) % vocab_size for position in range(length)])
