"""Weights that change under the patch: after ``model.update(...)``,
``model.load_weights(...)``, one optimizer step and ``nn.quantize(model)``,
patched and unpatched greedy logits are bit-identical again, so the patch
never runs a stale copy of a weight.

One case per synthetic model (the gated-delta fold and every family with a
small config in :mod:`helpers.mlx_lm_families`) and per
registered attention class's model file without one, so the file grows as
families are registered; a test fails if a registered class has no case.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map_with_path

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

from helpers.greedy_traces import assert_traces_bit_identical  # noqa: E402

from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import registry  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.engagement import layer_engagement  # noqa: E402
from mlx_dualnorm.commands.shared.generation import count_normalize_qk_calls, greedy_generate  # noqa: E402
from helpers.mlx_lm_families import (  # noqa: E402
    DEFAULT_DTYPES,
    SYNTHETIC_MODEL_TYPES,
    build_model,
    synthetic_model_config,
)

TOKENS = 6
GROUP_SIZE = 64
SMALL_ATTENTION = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "vocab_size": 256, "max_position_embeddings": 512, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
# Model files of registered classes the synthetic registry has no config of.
LOCAL_CONFIGS = {
    "qwen3": {"model_type": "qwen3", **SMALL_ATTENTION},
    "qwen3_moe": {
        "model_type": "qwen3_moe", **SMALL_ATTENTION, "num_experts": 4,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "moe_intermediate_size": 64,
        "mlp_only_layers": [], "norm_topk_prob": True,
    },
}


def _model_type(config: dict) -> str:
    return str(config["model_type"])


def cases() -> dict[str, tuple[dict, mx.Dtype]]:
    """name -> (config, dtype): every synthetic model, then the local
    configs of model files the synthetic registry does not cover."""
    found = {
        name: (synthetic_model_config(name), DEFAULT_DTYPES.get(name, mx.float32))
        for name in SYNTHETIC_MODEL_TYPES
    }
    covered = {_model_type(config) for config, _ in found.values()}
    for name, config in LOCAL_CONFIGS.items():
        if _model_type(config) not in covered:
            found[name] = (config, mx.float32)  # MLX's CPU gather_mm takes float32 only
    return found


CASES = cases()
PROMPT = mx.array([(37 * position + 11) % 256 for position in range(7)])


def registered_classes() -> tuple:
    return tuple(registry.families_by_class())


def build(name: str) -> nn.Module:
    config, dtype = CASES[name]
    return build_model(config, dtype=dtype)


def assert_patched_matches_unpatched(model: nn.Module, stage: str) -> list[mx.array]:
    """Greedy logits, unpatched then patched, bit-identical at every step;
    the patch engaged (a fold or an attention layer: a model it leaves
    wholly to mlx-lm, e.g. for its scaled RoPE, is skipped, as it proves
    nothing here). Returns the logits."""
    with integration.unpatch():
        reference = greedy_generate(model, PROMPT, TOKENS)
    with integration.patch(), count_normalize_qk_calls() as calls:
        patched = greedy_generate(model, PROMPT, TOKENS)
        record = layer_engagement(model)
    if record.engaged_layers + calls.folded == 0:
        left = "; ".join(f"{name}: {reason}" for name, reason in record.left)
        pytest.skip(f"{stage}: the patch leaves every layer to mlx-lm ({left})")
    assert_traces_bit_identical(reference, patched, steps=TOKENS + 1, context=stage)
    return reference.step_logits


def assert_changed(before: list[mx.array], after: list[mx.array], stage: str) -> None:
    """The change reached the logits (else the comparison proves nothing)."""
    assert any(
        not mx.array_equal(old, new).item() for old, new in zip(before, after)
    ), f"{stage}: the logits did not change"


def perturbed(model: nn.Module, seed: int) -> dict:
    """Every floating parameter times (1 + a random N(0, 0.25) factor)."""
    keys = iter(mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters()))))

    def perturb(_, value):
        key = next(keys)
        if not mx.issubdtype(value.dtype, mx.floating):
            return value
        factor = 1 + 0.25 * mx.random.normal(value.shape, key=key)
        return (value * factor).astype(value.dtype)

    return tree_map_with_path(perturb, model.parameters())


def test_every_registered_class_has_a_case():
    instantiated = set()
    for name in CASES:
        instantiated |= {type(module) for _, module in build(name).named_modules()}
    missing = [
        f"{attention_class.__module__}.{attention_class.__qualname__}"
        for attention_class in registered_classes()
        if attention_class not in instantiated
    ]
    assert not missing, f"no small model builds {missing}: add one to mlx_lm_synthetic"


@pytest.mark.parametrize("name", list(CASES))
def test_updated_loaded_and_trained_weights_are_followed(name):
    model = build(name)
    logits = assert_patched_matches_unpatched(model, "as built")

    with integration.patch():  # changed while patched, the layers decided
        model.update(perturbed(model, seed=1))
    updated = assert_patched_matches_unpatched(model, "after model.update")
    assert_changed(logits, updated, "model.update")

    model.load_weights(list(tree_flatten(perturbed(model, seed=2))), strict=True)
    loaded = assert_patched_matches_unpatched(model, "after model.load_weights")
    assert_changed(updated, loaded, "model.load_weights")

    def loss(tokens: mx.array) -> mx.array:
        logits = model(tokens[None, :-1])
        return nn.losses.cross_entropy(logits, tokens[None, 1:], reduction="mean")

    optimizer = optim.Adam(learning_rate=0.05)
    with integration.patch():  # the step runs through the patch, as training does
        _, gradients = nn.value_and_grad(model, loss)(PROMPT)
        optimizer.update(model, gradients)
        mx.eval(model.parameters(), optimizer.state)
    trained = assert_patched_matches_unpatched(model, "after an optimizer step")
    assert_changed(loaded, trained, "the optimizer step")


def _quantizable(path: str, module: nn.Module) -> bool:
    weight = module.get("weight") if isinstance(module, dict) else None
    return (
        hasattr(module, "to_quantized")
        and weight is not None
        and weight.shape[-1] % GROUP_SIZE == 0
    )


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_weights_are_followed(name):
    model = build(name)
    logits = assert_patched_matches_unpatched(model, "as built")
    with integration.patch():
        nn.quantize(model, group_size=GROUP_SIZE, bits=4, class_predicate=_quantizable)
    assert any(isinstance(module, nn.QuantizedLinear) for _, module in model.named_modules())
    try:
        with integration.unpatch():
            mx.eval(model(PROMPT[None]))
    except (ValueError, RuntimeError) as error:  # MLX cannot run this family quantized here
        pytest.skip(f"{name} does not run quantized on {mx.default_device()}: {error}")
    quantized = assert_patched_matches_unpatched(model, "after nn.quantize")
    assert_changed(logits, quantized, "nn.quantize")

