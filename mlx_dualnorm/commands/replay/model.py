"""The replay's model: a small seeded Qwen3-Next-like hybrid (three gated-delta
layers, one full attention layer) whose q/k head norms run through the path under
test, with the real head widths and norm calls; the rest is small enough for a
few seconds on two CPU cores. The full-attention layer's whole q/k prework (norms,
transposes, RoPE at the cache's position) may be a path under test too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm.commands.shared.paths import ROPE_BASE, DualNormPath

GATED_DELTA_LAYER = "gated_delta"
FULL_ATTENTION_LAYER = "full_attention"
LayerCache = dict[str, mx.array]  # a layer's recurrent state, or its keys and values so far
# The full-attention layer's q/k prework: (B, L, H, D) queries and keys, their norm
# weights and the position of the first row -> normalized, rotated (B, H, L, D) heads.
NormRope = Callable[[mx.array, mx.array, mx.array, mx.array, int], tuple[mx.array, mx.array]]


@dataclass(frozen=True)
class ReplayModelConfig:
    """Head widths are the production ones; the rest is as small as keeps
    every code path meaningful."""

    vocabulary_size: int = 512
    model_width: int = 256
    layer_kinds: tuple[str, ...] = (GATED_DELTA_LAYER,) * 3 + (FULL_ATTENTION_LAYER,)
    gated_delta_key_heads: int = 2
    gated_delta_value_heads: int = 4  # two value heads per q/k head, as in Qwen3-Next
    gated_delta_head_width: int = 128
    gated_delta_value_width: int = 64
    attention_query_heads: int = 4
    attention_key_value_heads: int = 1
    attention_head_width: int = 256
    attention_rotary_width: int = 64  # partial rotary, as in Qwen3-Next
    rms_norm_eps: float = 1e-6
    dtype: mx.Dtype = mx.bfloat16
    prompt_length: int = 8
    seed: int = 20261129


_Weight = tuple[str, tuple[int, ...], str]  # name, shape, initialization


def _weight_shapes(config: ReplayModelConfig) -> list[_Weight]:
    """Every weight, in the order that ties each to its slice of the seed."""
    width = config.model_width
    shapes: list[_Weight] = [("embedding", (config.vocabulary_size, width), "embedding")]
    for layer_index, layer_kind in enumerate(config.layer_kinds):
        if layer_kind == GATED_DELTA_LAYER:
            value_heads = config.gated_delta_value_heads
            query_width = key_width = config.gated_delta_key_heads * config.gated_delta_head_width
            value_width = mixed_width = value_heads * config.gated_delta_value_width
            kind_weights: list[_Weight] = [
                ("decay_projection", (width, value_heads), "projection"),
                ("write_strength_projection", (width, value_heads), "projection"),
                ("decay_log_rate", (value_heads,), "decay_log_rate"),
                ("decay_time_bias", (value_heads,), "small"),
            ]
        elif layer_kind == FULL_ATTENTION_LAYER:
            head_width = config.attention_head_width
            query_width = mixed_width = config.attention_query_heads * head_width
            key_width = value_width = config.attention_key_value_heads * head_width
            kind_weights = [("query_norm_weight", (head_width,), "norm_weight"),
                            ("key_norm_weight", (head_width,), "norm_weight")]
        else:
            raise ValueError(f"unknown layer kind {layer_kind!r}")
        layer_weights = [
            ("input_norm_weight", (width,), "norm_weight"),
            ("query_projection", (width, query_width), "projection"),
            ("key_projection", (width, key_width), "projection"),
            ("value_projection", (width, value_width), "projection"),
            *kind_weights,
            ("output_projection", (mixed_width, width), "projection"),
        ]
        shapes += [(f"layers.{layer_index}.{name}", shape, init)
                   for name, shape, init in layer_weights]
    shapes += [
        ("final_norm_weight", (width,), "norm_weight"),
        ("language_model_head", (width, config.vocabulary_size), "projection"),
    ]
    return shapes


def build_replay_model(config: ReplayModelConfig = ReplayModelConfig()) -> dict[str, mx.array]:
    """Every weight of the replay model, from ``mx.random.key(config.seed)``."""
    shapes = _weight_shapes(config)
    parameter_keys = mx.random.split(mx.random.key(config.seed), len(shapes))
    parameters = {}
    for (name, shape, initialization), parameter_key in zip(shapes, parameter_keys):
        normal = mx.random.normal(shape, key=parameter_key)
        if initialization == "norm_weight":
            value = 1.0 + 0.1 * normal
        elif initialization == "projection":
            value = normal * (shape[0] ** -0.5)
        else:
            # decay_log_rate: rates of about [0.4, 2.7], decays from near 1 to ~0.1.
            value = normal * {"embedding": 1.0, "decay_log_rate": 0.3, "small": 0.1}[initialization]
        parameters[name] = value.astype(config.dtype)
    mx.eval(parameters)
    return parameters


def _gated_delta_mixer(
    normalized_input: mx.array, queries: mx.array, keys: mx.array, values: mx.array,
    weights: Mapping[str, mx.array], cache: LayerCache, config: ReplayModelConfig,
) -> mx.array:
    """The delta rule with a per-head decay g and write strength beta, state in
    float32: ``S = g * S``, ``S += k (beta * (v - S^T k))^T``, ``o = S^T q``."""
    batch, sequence_length, value_heads, value_width = values.shape
    # mlx-lm scales the normalized queries by 1/d and the keys by 1/sqrt(d).
    inverse_scale = config.gated_delta_head_width**-0.5
    repeats = value_heads // config.gated_delta_key_heads
    queries = mx.repeat(queries * (inverse_scale * inverse_scale), repeats, axis=2)
    keys = mx.repeat(keys * inverse_scale, repeats, axis=2)
    queries, keys, values = (array.astype(mx.float32) for array in (queries, keys, values))
    decay_input = (normalized_input @ weights["decay_projection"]).astype(mx.float32)
    decay_rate = mx.exp(weights["decay_log_rate"].astype(mx.float32))
    softplus = mx.logaddexp(decay_input + weights["decay_time_bias"].astype(mx.float32), 0.0)
    decay = mx.exp(-decay_rate * softplus)  # (batch, sequence, value heads), in (0, 1)
    write_strength = mx.sigmoid(
        (normalized_input @ weights["write_strength_projection"]).astype(mx.float32)
    )
    state = cache.get("state")
    if state is None:
        state = mx.zeros((batch, value_heads, keys.shape[-1], value_width), dtype=mx.float32)
    step_outputs = []
    for position in range(sequence_length):
        step_key = keys[:, position, :, :, None]  # (batch, heads, head width, 1)
        state = state * decay[:, position, :, None, None]
        remembered = (state * step_key).sum(axis=-2)  # S^T k
        correction = (values[:, position] - remembered) * write_strength[:, position, :, None]
        state = state + step_key * correction[:, :, None, :]
        step_outputs.append((state * queries[:, position, :, :, None]).sum(axis=-2))
    cache["state"] = state
    return mx.stack(step_outputs, axis=1).astype(config.dtype)


def composed_norm_rope(dual_head_norm: DualNormPath, config: ReplayModelConfig) -> NormRope:
    """The path's norms, then per side the transpose and ``mx.fast.rope`` (partial
    rotary), as mlx-lm's layers compose them."""

    def rotated(heads: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(heads.transpose(0, 2, 1, 3), config.attention_rotary_width,
                            traditional=False, base=ROPE_BASE, scale=1.0, offset=offset)

    def norm_rope(queries: mx.array, keys: mx.array, query_weight: mx.array,
                  key_weight: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        queries, keys = dual_head_norm(queries, keys, query_weight, key_weight)
        return rotated(queries, offset), rotated(keys, offset)

    return norm_rope


def _full_attention_mixer(
    normalized_input: mx.array, queries: mx.array, keys: mx.array, values: mx.array,
    weights: Mapping[str, mx.array], cache: LayerCache, config: ReplayModelConfig,
) -> mx.array:
    """Causal attention over the cache, of (B, H, L, D) queries and keys rotated at
    the cache's position."""
    head_major_values = values.transpose(0, 2, 1, 3)
    if "keys" in cache:
        keys = mx.concatenate([cache["keys"], keys], axis=2)
        head_major_values = mx.concatenate([cache["values"], head_major_values], axis=2)
    cache["keys"], cache["values"] = keys, head_major_values
    attended = mx.fast.scaled_dot_product_attention(
        queries, keys, head_major_values,
        scale=config.attention_head_width**-0.5,
        mask="causal" if queries.shape[2] > 1 else None,
    )
    return attended.transpose(0, 2, 1, 3)


def forward(
    token_ids: mx.array, parameters: Mapping[str, mx.array], caches: Sequence[LayerCache],
    config: ReplayModelConfig, dual_head_norm: DualNormPath,
    norm_rope: Optional[NormRope] = None,
) -> tuple[mx.array, mx.array]:
    """(logits, final normalized hidden states) for ``token_ids`` of shape
    ``(batch, sequence)``, advancing the caches. ``norm_rope``: the full-attention
    layer's q/k prework (default: ``dual_head_norm``, then the RoPE composed)."""
    attention_prework = norm_rope or composed_norm_rope(dual_head_norm, config)
    batch, sequence_length = token_ids.shape
    hidden = parameters["embedding"][token_ids]
    for layer_index, (layer_kind, cache) in enumerate(zip(config.layer_kinds, caches)):
        prefix = f"layers.{layer_index}."
        weights = {
            name.removeprefix(prefix): value for name, value in parameters.items()
            if name.startswith(prefix)
        }
        normalized_input = mx.fast.rms_norm(hidden, weights["input_norm_weight"],
                                            config.rms_norm_eps)
        if layer_kind == GATED_DELTA_LAYER:
            mixer = _gated_delta_mixer
            heads = (config.gated_delta_key_heads,) * 2 + (config.gated_delta_value_heads,)
        else:
            mixer = _full_attention_mixer
            heads = (config.attention_query_heads,) + (config.attention_key_value_heads,) * 2
        queries, keys, values = (
            (normalized_input @ weights[f"{name}_projection"]).reshape(
                batch, sequence_length, count, -1
            )
            for name, count in zip(("query", "key", "value"), heads)
        )
        # The path under test, as mlx-lm's models call it: weightless in gated-delta
        # layers (they have no q/k norm weights), weighted in full-attention layers.
        if layer_kind == GATED_DELTA_LAYER:
            queries, keys = dual_head_norm(queries, keys, None, None)
        else:
            queries, keys = attention_prework(
                queries, keys, weights["query_norm_weight"], weights["key_norm_weight"],
                cache["keys"].shape[2] if "keys" in cache else 0,
            )
        mixed = mixer(normalized_input, queries, keys, values, weights, cache, config)
        hidden = hidden + mixed.reshape(batch, sequence_length, -1) @ weights["output_projection"]
    final_hidden = mx.fast.rms_norm(hidden, parameters["final_norm_weight"], config.rms_norm_eps)
    return final_hidden @ parameters["language_model_head"], final_hidden
