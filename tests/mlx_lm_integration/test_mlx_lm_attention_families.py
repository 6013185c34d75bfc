"""The mlx-lm patch of attention families outside the qwen3 shape (q/k norms
after the transpose, per head before it with KV-shared layers, over the
whole projection; norms of weight ``w``, ``1 + w``, ``w + offset``): greedy
generation on a tiny random model of each mlx-lm file is token- and
logit-identical patched and unpatched, every layer that should engage
does (its norm modules no longer called), the others run mlx-lm's own code,
and the ``1 + w`` families follow their weights however they change."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_unflatten

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

from mlx_lm.tuner.trainer import default_loss  # noqa: E402

from helpers.bit_parity import assert_bit_identical  # noqa: E402
from helpers.greedy_traces import assert_traces_bit_identical  # noqa: E402
from helpers.mlx_lm_patch import (  # noqa: E402
    assert_patched_loss_and_gradients_match,
    count_applied_calls,
    count_module_calls,
    forget_proofs,
    one_token_step_loss,
)
from mlx_dualnorm import CompiledDualHeadNorm, available_modes  # noqa: E402
from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import cache_update, engine, head_norms  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import norm_rope  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.engagement import is_engaged_layer  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.state import STATE  # noqa: E402
from mlx_dualnorm.commands.shared.generation import compare_traces, greedy_generate  # noqa: E402
from helpers.mlx_lm_families import (  # noqa: E402
    build_model,
    build_synthetic_model,
    check_report,
    prompt_token_ids,
    randomize_norm_weights,
    synthetic_model_config,
)

GENERATED_TOKENS = 64
PROMPT = prompt_token_ids(512, 12)

# model -> (layers that engage, covered layers left to mlx-lm's code).
EXPECTED_LAYERS = {
    "afmoe": (3, 0),
    "openelm": (2, 0),
    "bailing_moe": (2, 0),
    "bailing_moe_linear": (2, 0),  # a full-attention and a linear-attention layer
    "bailing_hybrid": (1, 0),  # its linear-attention layer; MLA has no q/k head norms
    "gemma3_text": (2, 0),
    "plamo3": (2, 0),
    "minimax_m3_vl": (2, 0),  # a dense full-attention and a sparse-attention layer
    "gemma3n": (2, 2),  # the two KV-shared layers normalize q only
    "gemma4_text": (4, 2),
    "gear": (3, 0),  # two attention layers and a conv mixer
    "olmo2": (2, 0),
    "olmo3": (2, 0),
    "olmoe": (2, 0),
    "minimax": (2, 0),
    "olmo_hybrid": (1, 0),  # its gated-delta layer goes through normalize_qk
}
ONE_PLUS_WEIGHT_MODELS = ("gemma3_text", "gear", "minimax_m3_vl", "plamo3")


# Models whose engaged layers (some or all) take the norm + RoPE call: the
# layers whose RoPE it computes, their norms per head before or after the
# transpose, or over the whole projection.
NORM_ROPE_MODELS = (
    "openelm", "bailing_moe", "bailing_moe_linear", "gemma3_text", "plamo3", "gemma3n",
    "gemma4_text", "olmo2", "olmo3", "olmoe", "minimax", "olmo_hybrid",
)


@pytest.fixture
def pair_calls(monkeypatch):
    """Counts the q/k norm (+ RoPE) calls that went through the package, and
    those that did not (the layer then ran mlx-lm's own __call__). A norm +
    RoPE prework that does not apply (None) is followed by the q/k norm
    pair, which counts the call."""
    counts = {"package": 0, "original": 0}
    for name in ("normalized_pair", "normalized_rotated_heads"):
        entry_point = getattr(head_norms, name)

        def counting(*arguments, entry_point=entry_point):
            result = entry_point(*arguments)
            counts["package" if result is not None else "original"] += 1
            return result

        monkeypatch.setattr(head_norms, name, counting)
    count_applied_calls(monkeypatch, cache_update, "prework_and_cache_update", counts, "package")
    return counts


@pytest.fixture
def norm_module_calls(monkeypatch):
    """Counts, per norm module, the calls of the norm classes' own
    __call__: mlx-lm's code calls them, the patched layers do not."""
    yield count_module_calls(monkeypatch, head_norms.norm_kinds())
    forget_proofs()


def decided_layers(model):
    """How many covered layers the patch has engaged and left alone."""
    outcomes = [engine.decision_of(module) for _, module in model.named_modules()]
    engaged = [decision[0] for decision in outcomes if decision is not None]
    return engaged.count(True), engaged.count(False)


def q_k_norms(model):
    """(layer, its q norm, its k norm) of every layer with both."""
    for _, module in model.named_modules():
        for query_name, key_name in (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm")):
            query_norm, key_norm = module.get(query_name), module.get(key_name)
            if isinstance(query_norm, nn.Module) and isinstance(key_norm, nn.Module):
                yield module, query_norm, key_norm


@pytest.mark.parametrize("model_type", list(EXPECTED_LAYERS))
def test_greedy_generation_is_bit_identical(model_type, pair_calls, norm_module_calls):
    integration.clear_cache()
    model = build_synthetic_model(model_type)
    reference = greedy_generate(model, PROMPT, GENERATED_TOKENS)
    assert pair_calls == {"package": 0, "original": 0}
    reference_norm_calls = dict(norm_module_calls)
    norm_module_calls.clear()
    with integration.patch():
        patched = greedy_generate(model, PROMPT, GENERATED_TOKENS)
        engaged, left_alone = decided_layers(model)
        engaged_layers = [
            (layer, q_norm, k_norm) for layer, q_norm, k_norm in q_k_norms(model)
            if is_engaged_layer(layer)
        ]
        package_objects = [*head_norms._dual_norms.values(), *norm_rope._norm_ropes.values()]
        modes = {package_object.mode for package_object in package_objects}
        norm_ropes = len(norm_rope._norm_ropes)
        fallbacks = {entry.name: entry.fallbacks for entry in integration.report().classes
                     if entry.fallbacks}

    assert len(set(reference.token_ids)) > 8, "a degenerate model proves little"
    assert len(patched.step_logits) == GENERATED_TOKENS + 1
    assert_traces_bit_identical(reference, patched)
    assert (engaged, left_alone) == EXPECTED_LAYERS[model_type]
    assert modes == {"fused" if "fused" in available_modes() else "compiled"}
    # Norms and RoPE (plain or scaled, such as gemma4's proportional one on
    # its global layers) in one call where the layer's RoPE is covered.
    assert (norm_ropes > 0) is (model_type in NORM_ROPE_MODELS)
    # No engaged layer's call ran mlx-lm's code instead (a silent fallback).
    assert fallbacks == {}, fallbacks
    # Every engaged layer at the prompt and every generated step, through
    # the package, its norm modules not called; the others as before.
    assert pair_calls == {"package": engaged * (GENERATED_TOKENS + 2), "original": 0}
    assert len(engaged_layers) == engaged
    for _, query_norm, key_norm in engaged_layers:
        assert norm_module_calls[id(query_norm)] == norm_module_calls[id(key_norm)] == 0
        assert reference_norm_calls[id(query_norm)] == GENERATED_TOKENS + 2
    engaged_norms = {id(norm) for _, *norms in engaged_layers for norm in norms}
    for norm_id, calls in reference_norm_calls.items():
        if norm_id not in engaged_norms:
            assert norm_module_calls[norm_id] == calls


def test_gear_attention_without_a_softcap(pair_calls):
    """gear's attention layers without ``attn_logit_softcapping`` take
    mlx-lm's scaled_dot_product_attention instead."""
    config = synthetic_model_config("gear")
    config["attn_logit_softcapping"] = None
    model = build_model(config, dtype=mx.bfloat16)
    randomize_norm_weights(model, 11)
    reference = greedy_generate(model, PROMPT, 16)
    with integration.patch():
        patched = greedy_generate(model, PROMPT, 16)
    assert_traces_bit_identical(reference, patched)
    assert pair_calls == {"package": 3 * 18, "original": 0}


def test_kv_shared_layers_run_mlx_lms_code():
    """gemma4_text's KV-shared layers are decided once: the function they
    run is mlx-lm's own; no layer changes class."""
    model = build_synthetic_model("gemma4_text")
    attention_class = type(model.layers[0].self_attn)
    mlx_lm_call = attention_class.__call__
    with integration.patch():
        greedy_generate(model, PROMPT, 2)
        for layer in model.layers:
            attention = layer.self_attn
            assert isinstance(attention, attention_class)
            assert type(attention) is attention_class  # no class made per layer
            assert is_engaged_layer(attention) is attention.has_kv
            if not attention.has_kv:
                engaged, reason = engine.decision_of(attention)
                assert not engaged and reason, reason
                assert STATE.decisions[id(attention)].function is mlx_lm_call  # mlx-lm's function
    assert all(type(layer.self_attn) is attention_class for layer in model.layers)


def test_layers_whose_norms_differ_run_their_own_code(pair_calls, norm_module_calls):
    """A layer with two epsilons, or with a norm class the package does not
    know, keeps mlx-lm's __call__ and calls its own norms."""
    model = build_synthetic_model("olmo2")
    first, second = (layer.self_attn for layer in model.layers)
    second.k_norm.eps = 1e-5

    class OtherNorm(nn.RMSNorm):
        pass

    model.layers[0].self_attn.q_norm = OtherNorm(first.q_norm.weight.shape[0], eps=1e-6)
    reference = greedy_generate(model, PROMPT, 8)
    norm_module_calls.clear()
    with integration.patch():
        patched = greedy_generate(model, PROMPT, 8)
        assert decided_layers(model) == (0, 2)
    assert_traces_bit_identical(reference, patched)
    assert pair_calls == {"package": 0, "original": 0}
    assert norm_module_calls[id(second.q_norm)] == norm_module_calls[id(second.k_norm)] == 10


def test_norms_changed_after_the_decision_run_mlx_lms_code(pair_calls):
    """A layer that engaged and then had a norm swapped runs mlx-lm's
    __call__ from then on, call by call."""
    model = build_synthetic_model("gemma3_text")
    with integration.patch():
        greedy_generate(model, PROMPT, 2)
        model.layers[1].self_attn.k_norm.eps = 1e-3
        patched = greedy_generate(model, PROMPT, 8)
    reference = greedy_generate(model, PROMPT, 8)
    assert_traces_bit_identical(reference, patched)
    assert pair_calls["original"] == 10 and pair_calls["package"] == 2 * 4 + 10


def test_a_raising_norm_pair_runs_the_original(monkeypatch):
    model = build_synthetic_model("bailing_hybrid")
    reference = greedy_generate(model, PROMPT, 4)

    def broken(eps, mode):
        raise RuntimeError("broken")

    monkeypatch.setattr(head_norms, "dual_norm_for", broken)
    with integration.patch():
        patched = greedy_generate(model, PROMPT, 4)
    assert compare_traces(reference, patched).identical


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("mode", ["compiled", "composed"])
def test_heads_first_layout_is_bit_identical(dtype, mode):
    """Queries and keys transposed to (B, H, L, D) before the norm, as the
    heads-first families call it, with a weight of 1 + w: the package's
    call on those views gives mx.fast.rms_norm's bits."""
    queries = mx.random.normal((2, 5, 4, 32), key=mx.random.key(1)).astype(dtype)
    keys = mx.random.normal((2, 5, 2, 32), key=mx.random.key(2)).astype(dtype)
    queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
    query_weight = 1.0 + mx.random.normal((32,), key=mx.random.key(3)).astype(dtype)
    key_weight = 1.0 + mx.random.normal((32,), key=mx.random.key(4)).astype(dtype)
    with CompiledDualHeadNorm(1e-6, mode=mode) as dual_norm:
        for _ in range(2):  # the trace, then its replay
            normalized = dual_norm(queries, keys, query_weight, key_weight)
            assert_bit_identical(normalized[0], mx.fast.rms_norm(queries, query_weight, 1e-6))
            assert_bit_identical(normalized[1], mx.fast.rms_norm(keys, key_weight, 1e-6))


# ---- Weights that change after loading -------------------------------------------


def assert_patched_matches(model, tokens=8):
    reference = greedy_generate(model, PROMPT, tokens)
    with integration.patch():
        patched = greedy_generate(model, PROMPT, tokens)
    assert_traces_bit_identical(reference, patched)


def norm_weights(model, seed):
    """New values for every q/k norm weight: (path, array) pairs."""
    key = mx.random.key(seed)
    weights = []
    for path, value in tree_flatten(model.parameters()):
        if path.endswith(("q_norm.weight", "k_norm.weight")):
            key, draw = mx.random.split(key)
            weights.append((path, mx.random.normal(value.shape, key=draw).astype(value.dtype)))
    assert weights
    return weights


def assert_gradients_match(model):
    """mlx-lm's training loss and its gradients, patched and unpatched, the
    same bits; returns the gradients."""
    batch = mx.array([[(7 * column + 3) % 512 for column in range(9)]])
    lengths = mx.array([[1, 8]])
    loss_and_grad = nn.value_and_grad(model, default_loss)
    model.train()
    mx.eval(model(batch))  # gemma3n's AltUp casts its weights to float32 at its first call
    return assert_patched_loss_and_gradients_match(
        lambda: loss_and_grad(model, batch, lengths), lambda outputs: outputs[0]
    )


@pytest.mark.parametrize(
    "model_type", ["afmoe", "bailing_moe_linear", "gemma3n", "gemma4_text", "olmo2", "olmo3"]
)
def test_training_gradients_are_bit_identical(model_type, pair_calls):
    """One shape of each kind (and the norm + RoPE of the gemma layers):
    the loss and every gradient of an mlx-lm training step, patched and
    unpatched, bit for bit, with the package engaged."""
    assert_gradients_match(build_synthetic_model(model_type))
    assert pair_calls["package"] > 0 and pair_calls["original"] == 0


# The families whose layers normalize after the transpose and take the norm +
# RoPE call at one-token steps, one per norm class.
HEADS_FIRST_NORM_ROPE_MODELS = ("gemma3_text", "plamo3", "bailing_moe", "openelm")


@pytest.mark.parametrize("with_cache", [False, True], ids=["no-cache", "kv-cache"])
@pytest.mark.parametrize("model_type", HEADS_FIRST_NORM_ROPE_MODELS)
def test_one_token_step_gradients_are_bit_identical(model_type, with_cache, pair_calls):
    """A one-token step of two sequences, alone or after a prefill into
    mlx-lm's caches (the step then writes its KVCache in the package's
    call): the loss and every gradient, the norm weights' included, have
    mlx-lm's bits, through the norm + RoPE call that normalizes before the
    transpose."""
    model = build_synthetic_model(model_type)
    loss_and_grad = nn.value_and_grad(model, lambda m: one_token_step_loss(m, with_cache))
    gradients = assert_patched_loss_and_gradients_match(lambda: loss_and_grad(model))
    assert pair_calls["package"] > 0 and pair_calls["original"] == 0
    assert len(norm_rope._norm_ropes) > 0
    assert any(path.endswith("norm.weight") for path, _ in tree_flatten(gradients))


@pytest.mark.parametrize("model_type", ONE_PLUS_WEIGHT_MODELS)
def test_one_plus_weight_norms_follow_changed_weights(model_type):
    """The weight each norm passes (``1 + w``, gear's cast of it, plamo3's
    ``w + offset``) is computed from the module's current parameter at every
    call: after ``update``, ``load_weights``, an optimizer step and
    ``nn.quantize``, patched generation is still mlx-lm's, bit for bit, and
    the optimizer step's loss and gradients are too."""
    model = build_synthetic_model(model_type)
    with integration.patch():  # decided and cached with the first weights
        greedy_generate(model, PROMPT, 2)

    model.update(tree_unflatten(norm_weights(model, 1)))
    assert_patched_matches(model)

    loaded = dict(tree_flatten(model.parameters()))
    loaded.update(norm_weights(model, 2))
    model.load_weights(list(loaded.items()))
    assert_patched_matches(model)

    gradients = assert_gradients_match(model)
    optim.SGD(learning_rate=0.5).update(model, gradients)
    mx.eval(model.parameters())
    model.eval()
    assert_patched_matches(model)

    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: type(m) is nn.Linear)
    assert any(isinstance(module, nn.QuantizedLinear) for _, module in model.named_modules())
    assert_patched_matches(model)


def test_mlx_lm_check_reports_the_engaged_layers():
    identical, output = check_report("gemma3n", tokens=4)
    assert identical, output
    assert "attention layers engaged 2, left to mlx-lm's code 2" in output


def test_the_per_head_norm_and_rope_at_another_offset_is_one_call():
    """gemma3n's and gemma4_text's path where the offset is not the cache's:
    plain norms and nn.RoPE are ONE norm + RoPE call (not the norm pair and
    the layer's RoPE, and never mlx-lm's code), with mlx-lm's bits."""
    integration.clear_cache()
    query_norm, key_norm = nn.RMSNorm(16, eps=1e-6), nn.RMSNorm(16, eps=1e-6)
    rope = nn.RoPE(16, base=10_000.0)
    queries = mx.random.normal((1, 3, 4, 16), key=mx.random.key(1)).astype(mx.bfloat16)
    keys = mx.random.normal((1, 3, 2, 16), key=mx.random.key(2)).astype(mx.bfloat16)
    expected = [
        rope(norm(x).transpose(0, 2, 1, 3), offset=7)
        for norm, x in ((query_norm, queries), (key_norm, keys))
    ]
    with integration.patch():
        rotated = head_norms.normalized_rotated_heads(queries, keys, query_norm, key_norm, rope, 7)
    assert rotated is not None and len(norm_rope._norm_ropes) == 1
    for actual, reference in zip(rotated, expected):
        assert_bit_identical(actual, reference)
