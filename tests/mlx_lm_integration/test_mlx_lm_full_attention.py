"""The mlx-lm patch of full-attention layers (q/k norm + RoPE in one call):
greedy generation on mlx-lm's own qwen3, qwen3_moe and qwen3_next models
with random weights, and on qwen3 with each scaled RoPE of rope_utils the
patch covers, is token- and logit-identical patched and unpatched; layers
it does not cover run mlx-lm's own code; unpatch restores it all."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

from helpers.bit_parity import assert_bit_identical  # noqa: E402
from helpers.greedy_traces import assert_traces_bit_identical  # noqa: E402
from mlx_lm.models import rope_utils  # noqa: E402

from mlx_dualnorm import available_modes  # noqa: E402
from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import engine, norm_rope, qwen3  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm._shared import REPLACEMENT_MARKER  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.engagement import is_engaged_layer  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.state import STATE  # noqa: E402
from mlx_dualnorm.commands.shared.generation import compare_traces, greedy_generate  # noqa: E402
from helpers.mlx_lm_families import (  # noqa: E402
    build_synthetic_model,
    synthetic_model_config,
)

GENERATED_TOKENS = 64
SEED = 20261130

# mlx-lm's qwen3 and qwen3_moe as the package's synthetic models build them
# (two layers at Qwen3's head counts); SMALL_QWEN3 is the dense one's
# config without its model type, for tests that vary it.
CONFIGS = {name: synthetic_model_config(name) for name in ("qwen3", "qwen3_moe")}
SMALL_QWEN3 = {key: value for key, value in CONFIGS["qwen3"].items() if key != "model_type"}
# MLX 0.32's CPU gather_mm (the experts) takes float32 only.
DTYPES = {"qwen3": mx.bfloat16, "qwen3_moe": mx.float32, "qwen3_next": mx.float32}


def build_model(model_type):
    if model_type == "qwen3_next":  # the package's synthetic model: 1 of 4 layers attends
        return build_synthetic_model("qwen3_next", dtype=DTYPES[model_type])
    architecture = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(SEED)
    model = architecture.Model(architecture.ModelArgs.from_dict(CONFIGS[model_type]))
    model.set_dtype(DTYPES[model_type])
    mx.eval(model.parameters())
    model.eval()
    return model


def attention_layers(model):
    return [
        layer.self_attn for layer in model.layers if getattr(layer, "self_attn", None) is not None
    ]


@pytest.fixture
def prework_calls(monkeypatch):
    """Counts the full-attention calls that went through one norm + RoPE
    call, and those that ran mlx-lm's own __call__."""
    counts = {"fused": 0, "original": 0}
    prework = qwen3._prework_and_cache_update

    def counting(prework_of_layer, queries, keys, values, cache):
        result = prework(prework_of_layer, queries, keys, values, cache)
        counts["fused" if result is not None else "original"] += 1
        return result

    monkeypatch.setattr(qwen3, "_prework_and_cache_update", counting)
    return counts


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen3_next"])
def test_greedy_generation_is_bit_identical(model_type, prework_calls):
    model = build_model(model_type)
    layers = attention_layers(model)
    assert layers and all(type(layer.rope) is nn.RoPE for layer in layers)
    prompt = mx.array([(37 * position + 11) % 512 for position in range(12)])

    reference = greedy_generate(model, prompt, GENERATED_TOKENS)
    assert prework_calls == {"fused": 0, "original": 0}
    with integration.patch():  # mode "auto": the fused kernel on a CUDA GPU
        patched = greedy_generate(model, prompt, GENERATED_TOKENS)
        prework_modes = {built.mode for built in norm_rope._norm_ropes.values()}

    assert prework_modes == {"fused" if "fused" in available_modes() else "compiled"}
    assert len(set(reference.token_ids)) > 8, "a degenerate model proves little"
    assert_traces_bit_identical(reference, patched, steps=GENERATED_TOKENS + 1)
    # Every attention layer, at the prompt and every generated step.
    assert prework_calls == {"fused": len(layers) * (GENERATED_TOKENS + 2), "original": 0}


# rope_scaling of each scaled RoPE the patch covers, as a checkpoint's
# config.json gives it (initialize_rope builds the class); YaRN's mscale
# ratio is not 1, so its input scale is exercised.
SCALED_ROPES = {
    "llama3": ("Llama3RoPE", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 1024}),
    "yarn": ("YarnRoPE", {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                          "mscale_all_dim": 0.5, "original_max_position_embeddings": 1024}),
    "longrope": ("SuScaledRoPE", {"rope_type": "longrope",
                                  "original_max_position_embeddings": 1024,
                                  "short_factor": [1.0] * 64,
                                  "long_factor": [1.0 + 0.05 * i for i in range(64)]}),
    "proportional": ("ProportionalRoPE", {"rope_type": "proportional", "factor": 2.0,
                                          "partial_rotary_factor": 0.5}),
}


@pytest.mark.parametrize("rope_type", sorted(SCALED_ROPES))
def test_scaled_ropes_engage_and_are_bit_identical(rope_type, prework_calls):
    class_name, rope_scaling = SCALED_ROPES[rope_type]
    architecture = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(SEED)
    config = {"model_type": "qwen3", **SMALL_QWEN3, "rope_scaling": rope_scaling}
    model = architecture.Model(architecture.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    model.eval()
    layers = attention_layers(model)
    assert all(type(layer.rope) is getattr(rope_utils, class_name) for layer in layers)
    prompt = mx.array([(37 * position + 11) % 512 for position in range(12)])

    reference = greedy_generate(model, prompt, GENERATED_TOKENS)
    with integration.patch():
        patched = greedy_generate(model, prompt, GENERATED_TOKENS)
        assert all(is_engaged_layer(layer) for layer in layers)
    assert len(set(reference.token_ids)) > 8, "a degenerate model proves little"
    assert_traces_bit_identical(reference, patched)
    assert prework_calls == {"fused": len(layers) * (GENERATED_TOKENS + 2), "original": 0}


def test_a_replaced_frequency_table_is_followed():
    """The table is read at every call, never cached: replacing a layer's
    ``_freqs`` between generations changes the patched output exactly as
    it changes mlx-lm's own."""
    architecture = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(SEED)
    config = {"model_type": "qwen3", **SMALL_QWEN3, "rope_scaling": SCALED_ROPES["llama3"][1]}
    model = architecture.Model(architecture.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    prompt = mx.array(list(range(5, 17)))
    with integration.patch():
        before = greedy_generate(model, prompt, 8)
        for attention in attention_layers(model):
            attention.rope._freqs = 0.25 * attention.rope._freqs
        patched = greedy_generate(model, prompt, 8)
    reference = greedy_generate(model, prompt, 8)
    assert compare_traces(reference, patched).identical
    assert not compare_traces(before, patched).logits_bit_identical


def test_layers_with_other_ropes_run_their_own_code(prework_calls):
    """A layer whose RoPE the patch does not cover (DynamicNTKScalingRoPE:
    its base depends on the position) keeps mlx-lm's own __call__, decided
    once at its first call: from then on it runs mlx-lm's function itself,
    with nothing of the patch's inside it. The other layer still goes
    through the patch; neither changes class, and unpatching drops both
    decisions."""
    model = build_model("qwen3")
    first, second = attention_layers(model)
    second.rope = rope_utils.DynamicNTKScalingRoPE(
        128, max_position_embeddings=4096, traditional=False, base=1e6, factor=2.0
    )
    prompt = mx.array(list(range(3, 15)))
    reference = greedy_generate(model, prompt, 8)
    attention_class = type(first)
    mlx_lm_call = attention_class.__call__
    with integration.patch():
        patched = greedy_generate(model, prompt, 8)
        assert STATE.decisions[id(second)].function is mlx_lm_call
        assert engine.decision_of(second) == (False, qwen3_family_refusal())
        assert is_engaged_layer(first) and type(first) is type(second) is attention_class
    assert compare_traces(reference, patched).identical
    assert prework_calls == {"fused": 10, "original": 0}
    assert type(first) is type(second) is attention_class
    assert engine.decision_of(first) is engine.decision_of(second) is None
    assert attention_class.__call__ is mlx_lm_call


def qwen3_family_refusal() -> str:
    return next(
        family.refusal for family in integration.attention_families()
        if family.name == "mlx_lm.models.qwen3.Attention"
    )


def test_a_raising_prework_runs_the_original(monkeypatch):
    model = build_model("qwen3")
    prompt = mx.array(list(range(5, 17)))
    reference = greedy_generate(model, prompt, 4)

    def broken(rope, query_norm, key_norm, mode):
        raise RuntimeError("broken")

    monkeypatch.setattr(norm_rope, "norm_rope_for", broken)
    with integration.patch():
        patched = greedy_generate(model, prompt, 4)
    assert compare_traces(reference, patched).identical


def test_patch_replaces_and_unpatch_restores_every_class():
    classes = {
        f"{family.module}.{family.class_name}": family.attention_class()
        for family in integration.attention_families()
        if family.attention_class() is not None
    }
    assert len(classes) >= 3
    originals = {key: cls.__dict__["__call__"] for key, cls in classes.items()}
    with integration.patch():
        for key, cls in classes.items():
            assert cls.__call__ is not originals[key]
            assert getattr(cls.__call__, REPLACEMENT_MARKER) is True
        integration.patch()  # twice: the originals are still what unpatch restores
    for key, cls in classes.items():
        assert cls.__dict__["__call__"] is originals[key]
    integration.patch(mode="composed")
    integration.unpatch()
    for key, cls in classes.items():
        assert cls.__dict__["__call__"] is originals[key]


def test_modes_reach_the_norm_rope(prework_calls):
    model = build_model("qwen3")
    prompt = mx.array(list(range(2, 9)))
    reference = greedy_generate(model, prompt, 3)
    integration.clear_cache()
    with integration.patch(mode="composed"):
        patched = greedy_generate(model, prompt, 3)
    assert compare_traces(reference, patched).identical
    modes = {built.mode for built in norm_rope._norm_ropes.values()}
    assert modes == {"composed"}
    integration.clear_cache()


def test_constants_changed_in_place_after_patching_are_followed():
    """A layer's constants are read at every call: changing a RoPE base and
    the norms' eps in place between generations changes the patched output
    exactly as it changes mlx-lm's own."""
    model = build_model("qwen3")
    prompt = mx.array(list(range(5, 17)))
    with integration.patch():
        greedy_generate(model, prompt, 2)
        for attention in attention_layers(model):
            attention.rope.base = 10_000.0
            attention.q_norm.eps = attention.k_norm.eps = 1e-2
        patched = greedy_generate(model, prompt, 8)
    reference = greedy_generate(model, prompt, 8)
    assert compare_traces(reference, patched).identical


def test_keyword_arguments_reach_the_decided_call(prework_calls):
    """The first call passes its arguments on as given: a layer called with
    keywords decides and runs the same as one called positionally."""
    model = build_model("qwen3")
    first, second = attention_layers(model)
    x = mx.random.normal((1, 5, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    expected = [first(x, mask="causal"), second(x, None, None)]
    with integration.patch():
        actual = [first(x, mask="causal", cache=None), second(x=x)]
        assert is_engaged_layer(first) and is_engaged_layer(second)
    for result, reference in zip(actual, expected):
        assert_bit_identical(result, reference)
    assert prework_calls == {"fused": 2, "original": 0}
