"""The decoder-layer replay (integrations/mlx_lm/decoder_layer.py): every
registered decoder layer class's second half as one compiled replay, bit
for bit, and what the layer's class reads at each call read at each call
(weights updated or quantized in place, a projection swapped for an
adapter, mlx-lm's ``swiglu`` or MLX's ``Linear.__call__`` replaced)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from helpers.bit_parity import assert_bit_identical  # noqa: E402
from helpers.greedy_traces import greedy_logits  # noqa: E402
from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import decoder_layer, registry  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

LAYER_REPLAY = "layer replay"
PROMPT = mx.array([[3, 17, 5, 90, 41, 8]])

# Small configs of families with the decoder layer, with and without q/k norms.
SMALL = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "vocab_size": 128, "max_position_embeddings": 256,
    "rope_theta": 10_000.0, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False,
}
FAMILIES = ("llama", "qwen2", "qwen3", "internlm3", "seed_oss", "helium")


def build(model_type: str, dtype=mx.bfloat16, **overrides) -> nn.Module:
    architecture = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {"model_type": model_type, **SMALL, **overrides}
    args = architecture.ModelArgs.from_dict(config)
    mx.random.seed(7)
    model = architecture.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def decode(model, steps: int = 5, rows: mx.array = PROMPT) -> list[mx.array]:
    return greedy_logits(model, rows, make_prompt_cache(model), steps)


def assert_same_decode(model, context: str, **kwargs) -> list:
    """Greedy decode of ``model`` unpatched, then patched: bit-identical
    logits at every step; what each layer ran through the package."""
    with integration.unpatch():
        reference = decode(model, **kwargs)
    with integration.patch(), integration.recording() as recording:
        patched = decode(model, **kwargs)
        for step, (actual, expected) in enumerate(zip(patched, reference)):
            assert_bit_identical(actual, expected, f"{context} step {step}")
        return [recording.prework_of(layer) for layer in model.layers]


def test_every_registered_decoder_layer_class_is_proven_on_this_mlx_lm():
    with integration.patch():
        entries = {entry.name: entry for entry in integration.report().classes}
    present = [
        f"{module}.{layer}" for module, layer, _ in registry.DECODER_LAYERS
        if registry.class_of(module, layer) is not None
    ]
    assert len(present) >= 20
    for name in present:
        assert entries[name].patched and entries[name].kind == registry.DECODER_LAYER, name


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32, mx.float16])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_decode_is_bit_identical_and_every_layer_replays(model_type, dtype):
    model = build(model_type, dtype)
    replayed = assert_same_decode(model, f"{model_type} {dtype}")
    assert replayed == [LAYER_REPLAY] * len(model.layers)


@pytest.mark.parametrize("bits,group_size,mode", [(4, 32, "affine"), (8, 32, "affine"),
                                                   (4, 32, "mxfp4")])
def test_quantized_projections_are_replayed_bit_identically(bits, group_size, mode):
    model = build("llama")
    nn.quantize(model, group_size=group_size, bits=bits, mode=mode)
    replayed = assert_same_decode(model, f"quantized {bits} {mode}")
    assert replayed == [LAYER_REPLAY] * len(model.layers)


def test_projection_biases_are_replayed_bit_identically():
    model = build("llama", mlp_bias=True)
    assert "bias" in model.layers[0].mlp.gate_proj
    replayed = assert_same_decode(model, "mlp_bias")
    assert replayed == [LAYER_REPLAY] * len(model.layers)


def test_a_batch_of_rows_is_bit_identical():
    model = build("qwen3")
    rows = mx.array([[3, 17, 5, 90, 41, 8], [9, 2, 77, 13, 4, 60], [1, 1, 2, 3, 5, 8]])
    assert_same_decode(model, "batch 3", rows=rows)


def test_weights_updated_or_quantized_after_the_first_call_are_followed():
    model = build("llama")
    with integration.patch():
        decode(model, steps=1)  # decided and traced
        new = {name: value * 0.5 for name, value in
               nn.utils.tree_flatten(model.layers[0].mlp.parameters())}
        model.layers[0].mlp.update(nn.utils.tree_unflatten(list(new.items())))
        model.layers[1].post_attention_layernorm.weight = (
            model.layers[1].post_attention_layernorm.weight + 1
        )
        patched = decode(model)
        nn.quantize(model, group_size=32, bits=4)
        patched_quantized = decode(model)
    with integration.unpatch():
        reference_quantized = decode(model)
    for actual, expected in zip(patched_quantized, reference_quantized):
        assert_bit_identical(actual, expected, "quantized in place")
    model = build("llama")
    model.layers[0].mlp.update(nn.utils.tree_unflatten(list(new.items())))
    model.layers[1].post_attention_layernorm.weight = (
        model.layers[1].post_attention_layernorm.weight + 1
    )
    with integration.unpatch():
        reference = decode(model)
    for actual, expected in zip(patched, reference):
        assert_bit_identical(actual, expected, "updated weights")


class AdapterLinear(nn.Linear):
    """A LoRA-like projection: a Linear subclass that adds a scaled term."""

    def __call__(self, x):
        return super().__call__(x) + 0.25 * x[..., : self.weight.shape[0]].sum(-1, keepdims=True)


def replays_after(change, context: str) -> list:
    """A float32 llama decided and traced by one patched call, then
    ``change(model)``: its patched greedy decode is bit-identical to its
    unpatched one; what each layer ran through the package."""
    model = build("llama", dtype=mx.float32)
    with integration.patch():
        decode(model, steps=1)
        change(model)
        with integration.recording() as recording:
            patched = decode(model)
            replays = [recording.prework_of(layer) for layer in model.layers]
        with integration.unpatch():
            reference = decode(model)
    for actual, expected in zip(patched, reference):
        assert_bit_identical(actual, expected, context)
    return replays


def test_a_projection_swapped_for_an_adapter_runs_mlx_lm_s_code():
    def swap_for_an_adapter(model):
        mlp = model.layers[0].mlp
        adapter = AdapterLinear(mlp.gate_proj.weight.shape[1], mlp.gate_proj.weight.shape[0],
                                bias=False)
        adapter.weight = mlp.gate_proj.weight
        mlp.gate_proj = adapter

    assert replays_after(swap_for_an_adapter, "adapter") == [None, LAYER_REPLAY]


def test_a_swiglu_rebound_in_the_model_module_is_called(monkeypatch):
    module = importlib.import_module("mlx_lm.models.llama")

    def rebind(model):
        monkeypatch.setattr(module, "swiglu", lambda gate, x: nn.gelu(gate) * x)

    assert replays_after(rebind, "rebound swiglu")[0] is None


def test_linear_call_replaced_after_the_first_call_leaves_the_layers(monkeypatch):
    original = nn.Linear.__call__

    def replace(model):
        monkeypatch.setattr(nn.Linear, "__call__", lambda self, x: original(self, x) * 2)

    assert replays_after(replace, "Linear.__call__ replaced") == [None, None]


def test_a_layer_whose_mlp_is_not_a_swiglu_mlp_is_left_with_the_reason():
    model = build("qwen3_moe", dtype=mx.float32, num_experts=4, num_experts_per_tok=2,
                  decoder_sparse_step=1, moe_intermediate_size=32, mlp_only_layers=[],
                  norm_topk_prob=True)
    assert assert_same_decode(model, "qwen3_moe") == [None, None]
    with integration.patch():
        decode(model, steps=1)
        entry = {e.name: e for e in integration.report().classes}[
            "mlx_lm.models.qwen3_moe.Qwen3MoeDecoderLayer"]
    assert entry.kind == registry.DECODER_LAYER and entry.engaged_layers == 0
    assert entry.left_layers == {decoder_layer.REFUSAL: 2}


def test_the_composed_mode_replays_uncompiled_with_the_same_bits():
    model = build("qwen2")
    with integration.unpatch():
        reference = decode(model)
    with integration.patch(mode="composed"), integration.recording() as recording:
        patched = decode(model)
        assert recording.prework_of(model.layers[0]) == LAYER_REPLAY
    for actual, expected in zip(patched, reference):
        assert_bit_identical(actual, expected, "composed mode")


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "vmap"])
def test_transforms_of_a_layer_give_mlx_lm_s_bits(transform):
    model = build("llama", dtype=mx.float32)
    layer = model.layers[0]
    x = mx.random.normal((2, 3, SMALL["hidden_size"]), key=mx.random.key(3))

    def loss(inputs):
        return layer(inputs).sum()

    def run():
        if transform == "grad":
            return mx.grad(loss)(x)
        if transform == "vjp":
            return mx.vjp(layer, [x], [mx.ones_like(x)])[1][0]
        if transform == "jvp":
            return mx.jvp(layer, [x], [mx.ones_like(x)])[1][0]
        return mx.vmap(layer)(x[:, None])

    with integration.unpatch():
        expected = run()
    with integration.patch(), integration.recording() as recording:
        actual = run()
        assert recording.prework_of(layer) == LAYER_REPLAY
    assert_bit_identical(actual, expected, transform)


def test_training_the_mlp_gives_mlx_lm_s_gradients():
    model = build("llama", dtype=mx.float32)
    tokens = mx.array(np.arange(12).reshape(2, 6) % SMALL["vocab_size"])

    def loss(m):
        return nn.losses.cross_entropy(m(tokens[:, :-1]), tokens[:, 1:]).mean()

    with integration.unpatch():
        expected = nn.value_and_grad(model, loss)(model)
    with integration.patch():
        actual = nn.value_and_grad(model, loss)(model)
    assert_bit_identical(actual[0], expected[0], "loss")
    for (name, a), (_, b) in zip(nn.utils.tree_flatten(actual[1]),
                                 nn.utils.tree_flatten(expected[1])):
        assert_bit_identical(a, b, name)
