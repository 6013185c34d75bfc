"""The replay's model: a small deterministic decoder in the shape of a
Qwen3-Next / Qwen3.5 hybrid (three gated-delta layers, then one full
attention layer) whose query/key head norms run through the path under
test (:func:`build_replay_model`, one forward step in :func:`forward`).

What keeps it honest about the real thing, while staying under a few
seconds on two CPU cores:

- the head widths are the real ones: 128 for the gated-delta q/k heads,
  normalized weightless as mlx-lm does (``rms_norm(x, None, 1e-6)``, then
  scaled by 1/d and 1/sqrt(d)), and 256 for the full-attention heads,
  normalized with q/k norm weights (4 query heads sharing 1 key head);
- the norms see prefill shapes (the prompt at once) and decode shapes (one
  token per step), in bfloat16 by default;
- the gated-delta recurrence is the delta rule with a per-head decay and
  write strength: ``S = g * S``, ``S += k (beta * (v - S^T k))^T``,
  ``o = S^T q``, state kept in float32;
- everything else (embedding, widths, vocabulary of 512) is small, and every
  weight comes from one fixed ``mx.random.key``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm.commands.shared.paths import DualNormPath

__all__ = ["FULL_ATTENTION_LAYER", "GATED_DELTA_LAYER", "LayerCache", "ReplayModelConfig",
           "build_replay_model", "forward"]

GATED_DELTA_LAYER = "gated_delta"
FULL_ATTENTION_LAYER = "full_attention"


@dataclass(frozen=True)
class ReplayModelConfig:
    """The replay model's shape. Head widths are the production ones; the
    rest is as small as keeps every code path meaningful."""

    vocabulary_size: int = 512
    model_width: int = 256
    layer_kinds: tuple[str, ...] = (
        GATED_DELTA_LAYER,
        GATED_DELTA_LAYER,
        GATED_DELTA_LAYER,
        FULL_ATTENTION_LAYER,
    )
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


# ---- Weights ----------------------------------------------------------------------


def _parameter_shapes(config: ReplayModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, initialization) for every weight, in a fixed order:
    the order is what ties each weight to its slice of the seed."""
    width = config.model_width
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        ("embedding", (config.vocabulary_size, width), "embedding"),
    ]
    for layer_index, layer_kind in enumerate(config.layer_kinds):
        prefix = f"layers.{layer_index}."
        shapes.append((prefix + "input_norm_weight", (width,), "norm_weight"))
        if layer_kind == GATED_DELTA_LAYER:
            key_projection_width = config.gated_delta_key_heads * config.gated_delta_head_width
            value_projection_width = config.gated_delta_value_heads * config.gated_delta_value_width
            value_heads = config.gated_delta_value_heads
            shapes += _query_key_value_shapes(
                prefix, width, key_projection_width, key_projection_width, value_projection_width
            )
            shapes += [
                (prefix + "decay_projection", (width, value_heads), "projection"),
                (prefix + "write_strength_projection", (width, value_heads), "projection"),
                (prefix + "decay_log_rate", (value_heads,), "decay_log_rate"),
                (prefix + "decay_time_bias", (value_heads,), "small"),
                (prefix + "output_projection", (value_projection_width, width), "projection"),
            ]
        elif layer_kind == FULL_ATTENTION_LAYER:
            head_width = config.attention_head_width
            query_projection_width = config.attention_query_heads * head_width
            key_value_projection_width = config.attention_key_value_heads * head_width
            shapes += _query_key_value_shapes(
                prefix, width, query_projection_width, key_value_projection_width,
                key_value_projection_width,
            )
            shapes += [
                (prefix + "query_norm_weight", (head_width,), "norm_weight"),
                (prefix + "key_norm_weight", (head_width,), "norm_weight"),
                (prefix + "output_projection", (query_projection_width, width), "projection"),
            ]
        else:
            raise ValueError(f"unknown layer kind {layer_kind!r}")
    shapes += [
        ("final_norm_weight", (width,), "norm_weight"),
        ("language_model_head", (width, config.vocabulary_size), "projection"),
    ]
    return shapes


def _query_key_value_shapes(
    prefix: str, width: int, query_width: int, key_width: int, value_width: int
) -> list[tuple[str, tuple[int, ...], str]]:
    """The first weights of every layer kind: its query, key and value
    projections, in that order."""
    return [
        (prefix + "query_projection", (width, query_width), "projection"),
        (prefix + "key_projection", (width, key_width), "projection"),
        (prefix + "value_projection", (width, value_width), "projection"),
    ]


def build_replay_model(config: ReplayModelConfig = ReplayModelConfig()) -> dict[str, mx.array]:
    """Every weight of the replay model, from ``mx.random.key(config.seed)``."""
    shapes = _parameter_shapes(config)
    parameter_keys = mx.random.split(mx.random.key(config.seed), len(shapes))
    parameters = {}
    for (name, shape, initialization), parameter_key in zip(shapes, parameter_keys):
        standard_normal = mx.random.normal(shape, key=parameter_key)
        if initialization == "embedding":
            value = standard_normal
        elif initialization == "projection":
            value = standard_normal * (shape[0] ** -0.5)
        elif initialization == "norm_weight":
            value = 1.0 + 0.1 * standard_normal
        elif initialization == "decay_log_rate":
            # log of rates in about [0.4, 2.7]: decays from near 1 to ~0.1.
            value = 0.3 * standard_normal
        elif initialization == "small":
            value = 0.1 * standard_normal
        else:
            raise AssertionError(f"unhandled initialization {initialization!r}")
        parameters[name] = value.astype(config.dtype)
    mx.eval(parameters)
    return parameters


# ---- The model ----------------------------------------------------------------------


@dataclass
class LayerCache:
    """A gated-delta layer's recurrent state, or an attention layer's keys
    and values so far."""

    recurrent_state: Optional[mx.array] = None
    cached_keys: Optional[mx.array] = None
    cached_values: Optional[mx.array] = None

    def arrays(self) -> list[mx.array]:
        return [
            array
            for array in (self.recurrent_state, self.cached_keys, self.cached_values)
            if array is not None
        ]


@dataclass(frozen=True)
class _MixerInput:
    """What one layer's mixer reads: its normalized input, its weights (the
    model's under ``prefix``), its cache, and the path under test."""

    normalized_input: mx.array
    parameters: Mapping[str, mx.array]
    prefix: str
    cache: LayerCache
    config: ReplayModelConfig
    dual_head_norm: DualNormPath

    def weight(self, name: str) -> mx.array:
        return self.parameters[self.prefix + name]

    def query_key_value(
        self, query_heads: int, key_heads: int, value_heads: int
    ) -> tuple[mx.array, mx.array, mx.array]:
        """The query, key and value projections of the input, each split
        into its heads: ``(batch, sequence, heads, projection width / heads)``."""
        batch, sequence_length, _ = self.normalized_input.shape

        def heads_of(projection: str, heads: int) -> mx.array:
            projected = self.normalized_input @ self.weight(projection)
            return projected.reshape(batch, sequence_length, heads, -1)

        return (
            heads_of("query_projection", query_heads),
            heads_of("key_projection", key_heads),
            heads_of("value_projection", value_heads),
        )


def _gated_delta_mixer(layer: _MixerInput) -> mx.array:
    normalized_input, cache, config = layer.normalized_input, layer.cache, layer.config
    batch, sequence_length, _ = normalized_input.shape
    key_heads = config.gated_delta_key_heads
    value_heads = config.gated_delta_value_heads
    head_width = config.gated_delta_head_width
    value_width = config.gated_delta_value_width

    queries, keys, values = layer.query_key_value(key_heads, key_heads, value_heads)
    # The path under test, as mlx-lm's gated-delta layers call it:
    # weightless, then scaled (queries by 1/d, keys by 1/sqrt(d)).
    normalized_queries, normalized_keys = layer.dual_head_norm(queries, keys, None, None)
    inverse_scale = head_width**-0.5
    scaled_queries = normalized_queries * (inverse_scale * inverse_scale)
    scaled_keys = normalized_keys * inverse_scale
    value_heads_per_key_head = value_heads // key_heads
    scaled_queries = mx.repeat(scaled_queries, value_heads_per_key_head, axis=2).astype(mx.float32)
    scaled_keys = mx.repeat(scaled_keys, value_heads_per_key_head, axis=2).astype(mx.float32)
    values = values.astype(mx.float32)

    decay_input = (normalized_input @ layer.weight("decay_projection")).astype(mx.float32)
    decay_rate = mx.exp(layer.weight("decay_log_rate").astype(mx.float32))
    decay_time_bias = layer.weight("decay_time_bias").astype(mx.float32)
    softplus = mx.logaddexp(decay_input + decay_time_bias, 0.0)
    decay = mx.exp(-decay_rate * softplus)  # (batch, sequence, value heads), in (0, 1)
    write_strength = mx.sigmoid(
        (normalized_input @ layer.weight("write_strength_projection")).astype(mx.float32)
    )

    state = cache.recurrent_state
    if state is None:
        state = mx.zeros((batch, value_heads, head_width, value_width), dtype=mx.float32)
    step_outputs = []
    for position in range(sequence_length):
        step_key = scaled_keys[:, position, :, :, None]  # (batch, heads, head width, 1)
        state = state * decay[:, position, :, None, None]
        remembered_values = (state * step_key).sum(axis=-2)
        step_write_strength = write_strength[:, position, :, None]
        correction = (values[:, position] - remembered_values) * step_write_strength
        state = state + step_key * correction[:, :, None, :]
        step_outputs.append((state * scaled_queries[:, position, :, :, None]).sum(axis=-2))
    cache.recurrent_state = state
    mixed = mx.stack(step_outputs, axis=1).astype(config.dtype)
    return mixed.reshape(batch, sequence_length, value_heads * value_width) @ layer.weight(
        "output_projection"
    )


def _full_attention_mixer(layer: _MixerInput) -> mx.array:
    cache, config = layer.cache, layer.config
    batch, sequence_length, _ = layer.normalized_input.shape
    head_width = config.attention_head_width
    key_value_heads = config.attention_key_value_heads
    queries, keys, values = layer.query_key_value(
        config.attention_query_heads, key_value_heads, key_value_heads
    )
    # The path under test with q/k norm weights, as full-attention layers use it.
    normalized_queries, normalized_keys = layer.dual_head_norm(
        queries, keys, layer.weight("query_norm_weight"), layer.weight("key_norm_weight")
    )
    position_offset = 0 if cache.cached_keys is None else cache.cached_keys.shape[2]

    def rotated(normalized: mx.array) -> mx.array:
        """Head-major, RoPE at the cache's position."""
        return mx.fast.rope(
            normalized.transpose(0, 2, 1, 3),
            config.attention_rotary_width,
            traditional=False,
            base=10000.0,
            scale=1.0,
            offset=position_offset,
        )

    rotated_queries, rotated_keys = rotated(normalized_queries), rotated(normalized_keys)
    head_major_values = values.transpose(0, 2, 1, 3)
    if cache.cached_keys is not None and cache.cached_values is not None:
        rotated_keys = mx.concatenate([cache.cached_keys, rotated_keys], axis=2)
        head_major_values = mx.concatenate([cache.cached_values, head_major_values], axis=2)
    cache.cached_keys, cache.cached_values = rotated_keys, head_major_values
    attended = mx.fast.scaled_dot_product_attention(
        rotated_queries,
        rotated_keys,
        head_major_values,
        scale=head_width**-0.5,
        mask="causal" if sequence_length > 1 else None,
    )
    attended = attended.transpose(0, 2, 1, 3).reshape(
        batch, sequence_length, config.attention_query_heads * head_width
    )
    return attended @ layer.weight("output_projection")


def forward(
    token_ids: mx.array,
    parameters: Mapping[str, mx.array],
    caches: Sequence[LayerCache],
    config: ReplayModelConfig,
    dual_head_norm: DualNormPath,
) -> tuple[mx.array, mx.array]:
    """(logits, final normalized hidden states) for ``token_ids`` of shape
    ``(batch, sequence)``, advancing the caches."""
    hidden = parameters["embedding"][token_ids]
    for layer_index, (layer_kind, cache) in enumerate(zip(config.layer_kinds, caches)):
        prefix = f"layers.{layer_index}."
        normalized_input = mx.fast.rms_norm(
            hidden, parameters[prefix + "input_norm_weight"], config.rms_norm_eps
        )
        mixer = _gated_delta_mixer if layer_kind == GATED_DELTA_LAYER else _full_attention_mixer
        hidden = hidden + mixer(
            _MixerInput(normalized_input, parameters, prefix, cache, config, dual_head_norm)
        )
    final_hidden = mx.fast.rms_norm(hidden, parameters["final_norm_weight"], config.rms_norm_eps)
    return final_hidden @ parameters["language_model_head"], final_hidden
