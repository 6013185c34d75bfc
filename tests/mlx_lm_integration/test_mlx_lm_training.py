"""Training through the patch is training without it, bit for bit.

mlx-lm fine-tunes with ``nn.value_and_grad`` over its ``default_loss``,
eagerly or in the trainer's ``mx.compile``'d step with an optimizer, on
LoRA adapters (``linear_to_lora_layers``) or every weight, optionally with
gradient checkpointing. Each case here runs three such steps on a tiny
random-weight model, unpatched and then patched, and compares every loss,
every gradient and every updated parameter by bits.

The gated-delta fold is the case that needs this: its forward is a
weighted ``rms_norm``, bit-identical to mlx-lm's scalar multiply, but MLX
differentiates the two expressions differently on CUDA. The file runs on
whatever device MLX defaults to: CI runs it on the CPU, the GPU check runs
the same file on MLX's CUDA backend (fused mode).
"""

from __future__ import annotations

import copy
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")

from mlx_lm.tuner.trainer import default_loss, grad_checkpoint  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from helpers.bit_parity import assert_bit_identical  # noqa: E402
from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from helpers.mlx_lm_families import build_model, synthetic_model_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

STEPS = 3
BATCH = mx.array([[(7 * row + 5 * column + 3) % 512 for column in range(9)] for row in range(2)])
LENGTHS = mx.array([[1, 8], [1, 6]])  # (first, last) scored target positions per row
LORA_CONFIG = {"rank": 4, "scale": 8.0, "dropout": 0.0}


def tiny_config(model_type: str) -> dict:
    """A small model of the family; every family here engages the patch:
    qwen3_next and qwen3_5 in their gated-delta and full-attention layers,
    qwen3 in its norm + RoPE."""
    if model_type == "qwen3":
        return {
            "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 512,
            "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": True,
        }
    config = synthetic_model_config(model_type)
    text = config.get("text_config", config)
    # Dense MLPs: MLX's CPU gather_mm, which the experts use, takes float32
    # only. Fewer gated-delta heads of the real width keep each step short.
    text.update(
        num_experts=0, num_experts_per_tok=0, linear_num_key_heads=2, linear_num_value_heads=4,
        num_attention_heads=4, head_dim=64,
    )
    return config


def train(model_type, dtype, tuning, compiled, checkpointed):
    """(losses, gradients, parameters) of STEPS training steps on a fresh
    model: a list per step of the loss and of every gradient, then every
    parameter after the last update."""
    model = build_model(tiny_config(model_type), seed=7, dtype=dtype)
    if tuning == "lora":
        model.freeze()
        linear_to_lora_layers(model, 2, copy.deepcopy(LORA_CONFIG))
    model.train()
    optimizer = optim.Adam(learning_rate=1e-2)
    loss_value_and_grad = nn.value_and_grad(model, default_loss)

    def step(batch, lengths):
        (loss, _), gradients = loss_value_and_grad(model, batch, lengths)
        optimizer.update(model, gradients)
        return loss, gradients

    if compiled:
        state = [model.state, optimizer.state, mx.random.state]
        step = partial(mx.compile, inputs=state, outputs=state)(step)
    layer_class = type(model.layers[0])
    layer_call = layer_class.__call__
    if checkpointed:
        grad_checkpoint(model.layers[0])
    try:
        history = []
        for _ in range(STEPS):
            loss, gradients = step(BATCH, LENGTHS)
            mx.eval(loss, gradients, model.parameters())
            history.append([loss] + [value for _, value in tree_flatten(gradients)])
    finally:
        layer_class.__call__ = layer_call  # grad_checkpoint patches the class
    parameters = [value for _, value in tree_flatten(model.parameters())]
    return history, parameters


CASES = [
    pytest.param(model_type, dtype, tuning, compiled, checkpointed, id="-".join(
        [model_type, str(dtype).split(".")[-1], tuning, "compiled" if compiled else "eager"]
        + (["checkpointed"] if checkpointed else [])
    ))
    for model_type in ("qwen3_next", "qwen3_5", "qwen3")
    for dtype in (mx.float32, mx.bfloat16)
    for tuning in ("lora", "full")
    for compiled in (False, True)
    for checkpointed in ((False, True) if compiled and tuning == "lora" else (False,))
]


@pytest.mark.parametrize("model_type, dtype, tuning, compiled, checkpointed", CASES)
def test_training_steps_are_bit_identical(
    monkeypatch, model_type, dtype, tuning, compiled, checkpointed
):
    """Loss, every gradient and every updated parameter of three steps:
    the same bits patched and unpatched, and the patch really ran."""
    expected_history, expected_parameters = train(
        model_type, dtype, tuning, compiled, checkpointed
    )
    calls = count_composite_calls(monkeypatch)
    with integration.patch():
        actual_history, actual_parameters = train(
            model_type, dtype, tuning, compiled, checkpointed
        )
    monkeypatch.undo()
    assert sum(calls.values()) > 0, "the patch did not engage"
    assert len(actual_history) == len(expected_history)
    for actual_step, expected_step in zip(actual_history, expected_history):
        assert len(actual_step) == len(expected_step)
        for actual, expected in zip(actual_step, expected_step):
            assert_bit_identical(actual, expected)
    assert len(actual_parameters) == len(expected_parameters)
    for actual, expected in zip(actual_parameters, expected_parameters):
        assert_bit_identical(actual, expected)


def count_composite_calls(monkeypatch) -> dict:
    """Calls of the package's two composites from now until
    ``monkeypatch.undo()``, by class name (their ``__call__`` wrapped)."""
    import mlx_dualnorm

    counts: dict = {}
    for composite in (mlx_dualnorm.CompiledDualHeadNorm, mlx_dualnorm.CompiledDualHeadNormRope):

        def counted(self, *arguments, _call=composite.__call__, _name=composite.__name__, **options):
            counts[_name] = counts.get(_name, 0) + 1
            return _call(self, *arguments, **options)

        monkeypatch.setattr(composite, "__call__", counted)
    return counts
