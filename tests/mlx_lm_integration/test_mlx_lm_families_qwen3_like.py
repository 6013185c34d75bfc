"""The mlx-lm patch of the families whose attention has qwen3's q/k prework
under other names (Klear, dots1, lfm2, lfm2_moe, mellum, exaone4,
exaone_moe, apertus, glm4_moe / solar_open, laguna, step3p5, llama4_text):
greedy generation on a small random model of each is token- and
logit-identical patched and unpatched, every layer whose norms and RoPE the
package computes runs one call of it at each step, and every other layer
runs mlx-lm's own __call__ (its RoPE module called as mlx-lm calls it)."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

from helpers.greedy_traces import assert_traces_bit_identical  # noqa: E402
from helpers.mlx_lm_patch import (  # noqa: E402
    assert_patched_loss_and_gradients_match,
    count_module_calls,
    forget_proofs,
)
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import engine, head_norms, qwen3_like  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.engagement import is_engaged_layer  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.state import STATE  # noqa: E402
from mlx_dualnorm.commands.shared.generation import greedy_generate  # noqa: E402
from helpers.mlx_lm_families import (  # noqa: E402
    DEFAULT_DTYPES,
    build_model,
    build_synthetic_model,
    prompt_token_ids,
    synthetic_model_config,
)

GENERATED_TOKENS = 64
# generate_step runs the model on the prompt, on its last token, then once
# per generated token.
MODEL_CALLS = GENERATED_TOKENS + 2

# synthetic model -> (indices of its attention layers that engage, of
# those that run mlx-lm's own __call__, of those without RoPE).
LAYERS = {
    "Klear": ([0, 1], [], []),
    "dots1": ([0, 1], [], []),
    "lfm2": ([1], [], []),  # layer 0 is a convolution
    "lfm2_moe": ([1], [], []),
    "mellum": ([0, 1], [], []),
    "exaone4": ([0, 1], [], [1]),  # the global layer: its norm alone fused
    "exaone_moe": ([0, 1], [], [1]),
    "apertus": ([0, 1], [], []),
    "apertus-llama3": ([0, 1], [], []),  # llama3's frequency table
    "glm4_moe": ([0, 1], [], []),  # partial rotary
    "solar_open": ([0, 1], [], []),  # glm4_moe's attention
    "laguna": ([0, 1], [], []),  # layer 0: YaRN
    "laguna-partial": ([0, 1], [], []),
    "step3p5": ([0, 1], [], []),  # layer 0: YaRN
    "llama4_text": ([0, 1], [], [1]),
}
# name -> (synthetic model, config changes, engaged, left alone).
VARIANTS = {
    "solar_open-without-qk-norm": ("solar_open", {"use_qk_norm": False}, [0, 1], []),
    # Layer 1 has no RoPE: without norms it has no prework to take.
    "llama4_text-without-qk-norm": ("llama4_text", {"use_qk_norm": False}, [0], [1]),
}

_QK_NORM_WEIGHT = re.compile(r"\.self_attn\.(q|k)_(norm|layernorm)\.weight$")


def with_random_qk_norm_weights(model):
    """mlx-lm initializes norm weights to ones, which would hide a query
    and key weight mixed up: draws them at random instead."""
    weights = [
        (path, (1 + 0.25 * mx.random.normal(value.shape, key=mx.random.key(index)))
         .astype(value.dtype))
        for index, (path, value) in enumerate(tree_flatten(model.parameters()))
        if _QK_NORM_WEIGHT.search(path)
    ]
    model.update(tree_unflatten(weights))
    mx.eval(model.parameters())
    return model


def attention_layers(model) -> dict:
    return {
        index: layer.self_attn
        for index, layer in enumerate(model.layers)
        if getattr(layer, "self_attn", None) is not None
    }


@pytest.fixture
def call_counts(monkeypatch):
    """Per attention layer (by id): calls that went through the package's
    prework, and calls of its RoPE module (mlx-lm's own code calls it; the
    package's path reads its constants only)."""
    prework_calls: dict = {}
    rope_calls: dict = {}
    prework = qwen3_like.prework

    def counting_prework(layout, attention, mode, queries, keys, values, cache):
        prepared = prework(layout, attention, mode, queries, keys, values, cache)
        if prepared is not None:
            prework_calls[id(attention)] = prework_calls.get(id(attention), 0) + 1
        return prepared

    monkeypatch.setattr(qwen3_like, "prework", counting_prework)

    def count_ropes(model):
        ropes = [
            attention.rope for attention in attention_layers(model).values()
            if getattr(attention, "rope", None) is not None
        ]
        rope_classes = {type(rope) for rope in ropes}
        assert all("__call__" in vars(rope_class) for rope_class in rope_classes)  # once a call
        calls = count_module_calls(monkeypatch, rope_classes)
        rope_calls["of_layer"] = lambda layer: calls[id(getattr(layer, "rope", None))]

    yield prework_calls, rope_calls, count_ropes
    forget_proofs()


def check_family(model, engaged, left_alone, call_counts):
    prework_calls, rope_calls, count_ropes = call_counts
    layers = attention_layers(model)
    classes = {index: type(layer) for index, layer in layers.items()}
    mlx_lm_calls = {index: type(layer).__call__ for index, layer in layers.items()}
    prompt = prompt_token_ids(512)
    reference = greedy_generate(model, prompt, GENERATED_TOKENS)
    count_ropes(model)
    with integration.patch():
        patched = greedy_generate(model, prompt, GENERATED_TOKENS)
        decided = {index: is_engaged_layer(layer) for index, layer in layers.items()}
        fallbacks = {entry.name: entry.fallbacks for entry in integration.report().classes
                     if entry.fallbacks}
        for index in left_alone:  # mlx-lm's function itself, nothing of ours inside
            assert STATE.decisions[id(layers[index])].function is mlx_lm_calls[index]

    assert len(set(reference.token_ids)) > 8, "a degenerate model proves little"
    assert_traces_bit_identical(reference, patched, steps=GENERATED_TOKENS + 1)

    assert fallbacks == {}, fallbacks  # no engaged call ran mlx-lm's code instead
    assert sorted(index for index, on in decided.items() if on) == engaged
    assert sorted(index for index, on in decided.items() if not on) == left_alone
    assert {index: prework_calls.get(id(layers[index]), 0) for index in layers} == {
        index: MODEL_CALLS if index in engaged else 0 for index in layers
    }
    # Queries and keys: two RoPE calls per model call in mlx-lm's code.
    assert {index: rope_calls["of_layer"](layers[index]) for index in layers} == {
        index: 2 * MODEL_CALLS if index in left_alone and getattr(layers[index], "rope", None)
        is not None else 0
        for index in layers
    }
    # Unpatched again: the classes run mlx-lm's functions, no layer is decided.
    assert {index: type(layer) for index, layer in layers.items()} == classes
    assert {index: type(layer).__call__ for index, layer in layers.items()} == mlx_lm_calls
    assert not any(engine.decision_of(layer) for layer in layers.values())


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_greedy_generation_is_bit_identical(name, call_counts):
    engaged, left_alone, without_rope = LAYERS[name]
    model = with_random_qk_norm_weights(build_synthetic_model(name))
    layers = attention_layers(model)
    assert sorted(layers) == sorted(engaged + left_alone)
    assert sorted(
        index for index, layer in layers.items() if not getattr(layer, "use_rope", True)
    ) == without_rope
    integration.clear_cache()
    check_family(model, engaged, left_alone, call_counts)
    # A layer without RoPE had its norm alone fused.
    assert bool(head_norms._dual_norms) == bool(set(without_rope) & set(engaged))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_layers_without_qk_norms_take_the_rope_alone(name, call_counts):
    """A layer whose q/k norms are switched off rotates q and k as they
    are: the package's call made without norms, bit for bit, and the RoPE
    module no longer called."""
    family, changes, engaged, left_alone = VARIANTS[name]
    config = {**synthetic_model_config(family), **changes}
    model = build_model(config, dtype=DEFAULT_DTYPES[family])
    check_family(model, engaged, left_alone, call_counts)


def test_norms_of_two_epsilons_run_their_own_code(call_counts):
    """One layer's key norm gets another eps: that layer is left alone, the
    other still engages."""
    model = with_random_qk_norm_weights(build_synthetic_model("dots1"))
    attention_layers(model)[0].k_norm.eps = 1e-5
    check_family(model, [1], [0], call_counts)


def test_every_family_registers_its_class():
    registered = {
        (family.module, family.class_name) for family in integration.attention_families()
    }
    for family in qwen3_like.QWEN3_LIKE_FAMILIES:
        assert (family.module, family.class_name) in registered
        assert family.attention_class() is not None, family.module


@pytest.mark.parametrize("name", ["exaone4", "lfm2", "laguna", "llama4_text", "step3p5"])
def test_gradients_are_bit_identical(name):
    """A training step's loss and gradients of every parameter, patched
    and unpatched, on a forward pass without cache (as mlx-lm trains)."""
    import mlx.nn as nn

    model = with_random_qk_norm_weights(build_synthetic_model(name))
    inputs = prompt_token_ids(512, 16)[None]
    targets = mx.roll(inputs, -1, axis=1)

    def loss(module):
        logits = module(inputs).astype(mx.float32)
        return nn.losses.cross_entropy(logits, targets).mean()

    value_and_grad = nn.value_and_grad(model, lambda: loss(model))
    engaged = []

    def step():
        outputs = value_and_grad()
        mx.eval(outputs)
        engaged.append(any(
            is_engaged_layer(layer) for layer in attention_layers(model).values()
        ))
        return outputs

    gradients = assert_patched_loss_and_gradients_match(step)
    assert engaged[1], "the patched step did not engage the package"
    assert any(_QK_NORM_WEIGHT.search(path) for path, _ in tree_flatten(gradients)) or (
        name == "llama4_text"
    )
