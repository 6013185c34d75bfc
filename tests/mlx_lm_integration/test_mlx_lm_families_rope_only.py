"""The mlx-lm families whose attention has no q/k norms (llama, qwen2,
mixtral, phi3, ...): each layer's RoPE, transposes and cache write are one
call of the package made without norms. Greedy generation on a tiny
random model of each is token- and logit-identical patched and
unpatched, every attention layer engages (its RoPE module no longer
called), a RoPE the package does not compute runs mlx-lm's own code, a
layer changed after its first call is followed, and training gradients
are mlx-lm's bits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

from helpers.bit_parity import assert_bit_identical  # noqa: E402
from helpers.greedy_traces import assert_traces_bit_identical  # noqa: E402
from helpers.mlx_lm_patch import (  # noqa: E402
    assert_patched_loss_and_gradients_match,
    count_module_calls,
    forget_proofs,
    one_token_step_loss,
)
from mlx_dualnorm import CompiledDualHeadNormRope  # noqa: E402
from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import rope_only  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.engagement import (  # noqa: E402
    ROPE_ONLY,
    is_engaged_layer,
    recording,
)
from mlx_dualnorm.commands.shared.generation import greedy_generate  # noqa: E402
from helpers.mlx_lm_families import (  # noqa: E402
    build_model,
    build_synthetic_model,
    prompt_token_ids,
    synthetic_model_config,
)
from helpers.mlx_lm_families import ROPE_ONLY_CONFIGS  # noqa: E402

GENERATED_TOKENS = 24
PROMPT = prompt_token_ids(512, 12)
# Models whose layers do not all engage: which do (default: both of two).
# cohere2's global layers (1 and 3) have no RoPE: no prework to take.
# (MLX's named_modules lists the last layer first.)
ENGAGED = {"cohere2": [False, True, False, True]}


def attention_layers(model) -> list:
    """The model's layers of a class this module registers, in order."""
    classes = {
        family.attention_class()
        for family in (*rope_only.ROPE_ONLY_FAMILIES, rope_only.MINISTRAL3_FAMILY)
    }
    return [module for _, module in model.named_modules() if type(module) in classes]


@pytest.fixture
def package_calls(monkeypatch):
    """Counts the calls of the norm + RoPE object made without norms (its
    call and its call with the cache write)."""
    counts = {"calls": 0}
    for name in ("__call__", "apply_with_cache"):
        original = getattr(CompiledDualHeadNormRope, name)

        def counting(self, *arguments, original=original, **keywords):
            if self.eps is None:
                counts["calls"] += 1
            return original(self, *arguments, **keywords)

        monkeypatch.setattr(CompiledDualHeadNormRope, name, counting)
    yield counts
    forget_proofs()


def rope_module(layer):
    """The layer's RoPE module (Qwen (1) names it ``rotary_emb``), None for
    a layer without RoPE (cohere2's global layers)."""
    if "rotary_emb" in layer:
        return layer.rotary_emb
    return layer.rope if getattr(layer, "use_sliding_window", True) else None


def rope_module_calls(monkeypatch, layers):
    return count_module_calls(monkeypatch, {type(rope_module(layer)) for layer in layers})


def generate_both(model):
    """(unpatched, patched) greedy traces, and the layers engaged, with the
    prework each recorded, while patched."""
    reference = greedy_generate(model, PROMPT, GENERATED_TOKENS)
    with integration.patch(), recording() as record:
        patched = greedy_generate(model, PROMPT, GENERATED_TOKENS)
        layers = attention_layers(model)
        engaged = [is_engaged_layer(layer) for layer in layers]
        prework = [record.prework_of(layer) for layer in layers]
        fallbacks = {entry.name: entry.fallbacks for entry in integration.report().classes
                     if entry.fallbacks}
    return reference, patched, engaged, prework, fallbacks


@pytest.mark.parametrize("name", sorted(ROPE_ONLY_CONFIGS))
def test_greedy_generation_is_bit_identical_and_every_layer_engages(
    name, package_calls, monkeypatch
):
    model = build_synthetic_model(name)
    layers = attention_layers(model)
    expected = ENGAGED.get(name, [True, True])
    assert len(layers) == len(expected)
    rope_calls = rope_module_calls(
        monkeypatch, [layer for layer in layers if rope_module(layer) is not None]
    )
    reference, patched, engaged, prework, fallbacks = generate_both(model)
    assert_traces_bit_identical(reference, patched, steps=GENERATED_TOKENS + 1, context=name)
    assert engaged == expected
    assert prework == [ROPE_ONLY if on else None for on in expected]
    assert fallbacks == {}
    # One package call per engaged layer and model call (generate_step runs
    # the prompt but its last token, then one call per token); mlx-lm's
    # RoPE modules ran only unpatched (two per layer and call: q and k).
    model_calls = GENERATED_TOKENS + 2
    assert package_calls["calls"] == sum(expected) * model_calls
    assert [rope_calls[id(rope_module(layer))] for layer, on in zip(layers, expected) if on] == [
        2 * model_calls
    ] * sum(expected)


def test_a_rope_the_package_does_not_compute_runs_mlx_lm_s_code(package_calls):
    """llama with ``rope_scaling`` dynamic: DynamicNTKScalingRoPE's base
    depends on the input length, so its layers keep mlx-lm's own call."""
    config = {**synthetic_model_config("llama"),
              "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    model = build_model(config, dtype=mx.bfloat16)
    reference, patched, engaged, _, _ = generate_both(model)
    assert_traces_bit_identical(reference, patched)
    assert engaged == [False, False]
    assert package_calls["calls"] == 0


class Unrotated(nn.Module):
    """A position-free "RoPE" (as smollm3's NoPE layers hold)."""

    def __call__(self, x, offset=0):
        return x


def test_a_layer_changed_after_its_first_call_is_followed(package_calls):
    """The RoPE module is read at every call: one replaced by a RoPE of
    other constants mid-generation rotates with those (the new object's
    call), and one replaced by a module the package does not compute
    sends that layer back to mlx-lm's code; both as unpatched."""
    def generate_with_changes(model):
        greedy_generate(model, PROMPT, 2)
        layers = attention_layers(model)
        layers[0].rope = nn.RoPE(layers[0].rope.dims, traditional=True, base=500.0)
        first = greedy_generate(model, PROMPT, 4)
        layers[1].rope = Unrotated()
        second = greedy_generate(model, PROMPT, 4)
        return first, second

    reference = generate_with_changes(build_synthetic_model("llama"))
    with integration.patch():
        patched = generate_with_changes(build_synthetic_model("llama"))
    for expected, actual in zip(reference, patched):
        assert_traces_bit_identical(expected, actual)
    assert package_calls["calls"] > 0


@pytest.mark.parametrize("name", ["llama", "phi3", "internlm2", "qwen2-yarn"])
def test_training_gradients_are_bit_identical(name):
    """A training step's loss and the gradient of every parameter, patched
    and unpatched, on a forward pass without cache (as mlx-lm trains)."""
    model = build_synthetic_model(name, dtype=mx.float32)
    inputs = PROMPT[None]
    targets = mx.roll(inputs, -1, axis=1)

    def loss():
        return nn.losses.cross_entropy(model(inputs), targets).mean()

    value_and_grad = nn.value_and_grad(model, loss)
    engaged = []

    def step():
        outputs = value_and_grad()
        mx.eval(outputs)
        engaged.append(all(is_engaged_layer(layer) for layer in attention_layers(model)))
        return outputs

    assert_patched_loss_and_gradients_match(step)
    assert engaged[1], "the patched step did not engage the package"



@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "dbrx"])
@pytest.mark.parametrize("with_cache", [False, True], ids=["alone", "after-prefill"])
def test_one_token_step_gradients_are_bit_identical(name, with_cache, package_calls):
    """A one-token step of two sequences, alone or after a prefill into
    mlx-lm's caches (the step's keys then reach the prefill's through the
    cache write): loss and every gradient are mlx-lm's bits."""
    model = build_synthetic_model(name, dtype=mx.float32)
    loss_and_grad = nn.value_and_grad(model, lambda m: one_token_step_loss(m, with_cache))
    assert_patched_loss_and_gradients_match(lambda: loss_and_grad(model))
    assert package_calls["calls"] > 0


def test_a_call_the_class_refuses_is_refused_patched_too():
    """gpt_oss's attention takes ``mask`` without a default: a call without
    it is a TypeError unpatched, and patched as well (not a run)."""
    layer = attention_layers(build_synthetic_model("gpt_oss"))[0]
    x = mx.zeros((1, 2, 64), mx.float32)
    with pytest.raises(TypeError, match="'mask'"):
        layer(x)
    with integration.patch(), pytest.raises(TypeError, match="'mask'"):
        layer(x)


def test_ministral3_scales_the_queries_as_its_class_does(package_calls):
    """ministral3's model passes the queries' position scale; called
    without one, its attention computes it from the offset before the
    cache update. Both ways, over a prefill and decode steps into a
    KVCache, the layer's output and the cache are mlx-lm's bits."""
    from mlx_lm.models.cache import KVCache

    def steps(layer, scale):
        cache = KVCache()
        outputs = []
        for length, seed in ((5, 1), (1, 2), (1, 3)):
            x = mx.random.normal((1, length, 64), key=mx.random.key(seed)).astype(mx.bfloat16)
            attn_scale = None if scale is None else mx.array(scale, mx.bfloat16)
            outputs.append(layer(x, attn_scale, "causal" if length > 1 else None, cache))
        return [*outputs, cache.keys, cache.values]

    layer = attention_layers(build_synthetic_model("ministral3"))[0]
    for scale in (None, 1.25):
        expected = steps(layer, scale)
        with integration.patch():
            actual = steps(layer, scale)
        for got, wanted in zip(actual, expected):
            assert_bit_identical(got, wanted)
    assert package_calls["calls"] == 6
