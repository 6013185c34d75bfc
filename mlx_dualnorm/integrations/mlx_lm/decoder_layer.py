"""Pre-norm decoder layers with a SwiGLU MLP: the second half of the layer
as ONE compiled replay.

The layers of :data:`.registry.DECODER_LAYERS` (llama, qwen2, qwen3,
deepseek, glm4_moe, ... : with or without q/k norms) compute::

    h = x + self_attn(input_layernorm(x), mask, cache)
    return h + down_proj(swiglu(gate_proj(n), up_proj(n)))   # n = post_attention_layernorm(h)

On the GPU a decode step is host-bound: each of those Python calls and
graph nodes costs time whatever it computes. The replacement runs the
first line as mlx-lm does (the attention through its own ``__call__``,
patched or not) and the second as one ``mx.compile`` replay of the same
operations: the residual add, ``mx.fast.rms_norm``, the three
projections (plain ``x @ W.T``, ``mx.addmm`` with a bias, or
``mx.quantized_matmul`` as ``nn.QuantizedLinear`` calls it), mlx-lm's own
``swiglu`` and the second residual add. Compiling keeps each operation's
own arithmetic and dtype, so the result has the composed path's bits (on
the CPU and the GPU, under ``grad``, ``vjp``, ``jvp`` and ``vmap``; the
tests and ``bench/layer_ceilings.py`` check it).

Nothing is served stale from the trace: every array (the activations, the
norm's and projections' weights, scales and biases) is an input of each
call, read from the layer at that call; only what the trace is built
from is its key: the norm's eps, which projection kind each is (and a
quantized one's group size, bits and mode) and the ``swiglu`` object the
MLP's module holds. So ``model.update``, loaded or trained weights and
quantizing in place are followed at the next call; an MLP whose
projection is of any other class (a LoRA adapter, say) or whose module's
``swiglu`` is not an MLX compiled function runs the rest of the layer as
mlx-lm writes it, op for op. In the ``composed`` mode the replay runs
uncompiled.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm._composite import Mode
from mlx_dualnorm.integrations.mlx_lm._shared import (
    cached_or_built,
    log_fallback_once,
)
from mlx_dualnorm.integrations.mlx_lm.engine import count_fallback
from mlx_dualnorm.integrations.mlx_lm.prework_log import LAYER_REPLAY, note_prework
from mlx_dualnorm.integrations.mlx_lm.registry import (
    DECODER_LAYER,
    DECODER_LAYERS,
    PROJECTION_CLASSES,
    AttentionFamily,
    defined_class,
    defined_classes,
    register_attention_families,
)
from mlx_dualnorm.integrations.mlx_lm.state import STATE

PLACE = "the decoder layer's replay"
REFUSAL = "its post-attention norm is not nn.RMSNorm or its MLP is not a proven SwiGLU MLP"

# What mx.compile returns (mlx.nn.silu is one): the only kind of swiglu the
# replay calls inside its trace, since a compiled function is pure.
_COMPILED_FUNCTION = type(nn.silu)

# Projection kinds, the first item of a projection's key.
_MATMUL, _ADDMM, _QUANTIZED = "matmul", "addmm", "quantized"

# MLX's classes as their modules define them (a name the program rebinds,
# ``nn.RMSNorm = MyNorm`` say, changes nothing here): found once, since
# class objects do not change; the decision holds their ``__call__``.
_RMS_NORM = defined_class("mlx.nn.layers.normalization", "RMSNorm")
_LINEAR, _QUANTIZED_LINEAR = defined_classes(PROJECTION_CLASSES)

# key -> the second half (compiled or not), built once per key.
_replays: dict = {}
_replays_lock = threading.Lock()


def _projection(module: Any) -> Optional[tuple[tuple, tuple]]:
    """(key, arrays) of one projection as its class's ``__call__`` reads it
    at a call, or None where it is not exactly ``nn.Linear`` or
    ``nn.QuantizedLinear`` (whose ``__call__`` the decision holds proven)."""
    kind = type(module)
    if kind is _LINEAR:
        if "bias" in module:
            return (_ADDMM,), (module["weight"], module["bias"])
        return (_MATMUL,), (module["weight"],)
    if kind is _QUANTIZED_LINEAR:
        biases, bias = module.get("biases"), module.get("bias")
        key = (
            _QUANTIZED, module.group_size, module.bits, module.mode,
            biases is not None, "bias" in module,
        )
        arrays = (module["weight"], module["scales"])
        arrays += (biases,) if biases is not None else ()
        arrays += (bias,) if "bias" in module else ()
        return key, arrays
    return None


def _projected(key: tuple, x: mx.array, arrays: list) -> mx.array:
    """``x`` through one projection of ``key``, its arrays taken from the
    front of ``arrays``: the operations of its class's ``__call__``."""
    if key[0] == _MATMUL:
        return x @ arrays.pop(0).T
    if key[0] == _ADDMM:
        weight, bias = arrays.pop(0), arrays.pop(0)
        return mx.addmm(bias, x, weight.T)
    _, group_size, bits, mode, has_biases, has_bias = key
    weight, scales = arrays.pop(0), arrays.pop(0)
    biases = arrays.pop(0) if has_biases else None
    x = mx.quantized_matmul(
        x, weight, scales=scales, biases=biases, transpose=True,
        group_size=group_size, bits=bits, mode=mode,
    )
    return x + arrays.pop(0) if has_bias else x


def _build(eps: float, swiglu: Callable, keys: tuple, compiled: bool) -> Callable:
    """The second half for one key: ``(x, r, norm weight, *projection
    arrays) -> h + mlp(rms_norm(h))`` with ``h = x + r``, the projections'
    arrays in gate, up, down order."""
    gate_key, up_key, down_key = keys

    def second_half(x, attention_output, norm_weight, *projection_arrays):
        arrays = list(projection_arrays)
        h = x + attention_output
        normed = mx.fast.rms_norm(h, norm_weight, eps)
        gate = _projected(gate_key, normed, arrays)
        up = _projected(up_key, normed, arrays)
        return h + _projected(down_key, swiglu(gate, up), arrays)

    return mx.compile(second_half) if compiled else second_half


def _replay(layer: Any, mode: Optional[Mode]) -> Optional[tuple[Callable, tuple]]:
    """(the second half, its arrays) for this call of ``layer``, or None
    where the call must run the rest of the layer as mlx-lm writes it."""
    norm: Any = dict.get(layer, "post_attention_layernorm")
    mlp: Any = dict.get(layer, "mlp")
    swiglu = type(mlp).__call__.__globals__.get("swiglu")
    if type(swiglu) is not _COMPILED_FUNCTION:
        return None
    gate = _projection(dict.get(mlp, "gate_proj"))
    up = _projection(dict.get(mlp, "up_proj"))
    down = _projection(dict.get(mlp, "down_proj"))
    if gate is None or up is None or down is None:
        return None
    eps = norm.eps
    if type(eps) not in (float, int):
        return None
    key = (eps, swiglu, (gate[0], up[0], down[0]), mode != "composed")
    function = cached_or_built(_replays, _replays_lock, key, lambda: _build(*key), None)
    if function is None:
        return None
    return function, (norm["weight"], *gate[1], *up[1], *down[1])


def _decoder_layer_call(self, mode, x, mask=None, cache=None):
    """The layer's ``__call__`` with its second half one replay."""
    attention_output = self.self_attn(self.input_layernorm(x), mask, cache)
    try:
        replay = _replay(self, mode)
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once(PLACE, error)
        replay = None
    if replay is None:
        count_fallback(self)
        h = x + attention_output
        r = self.mlp(self.post_attention_layernorm(h))
        return h + r
    function, arrays = replay
    if STATE.prework_log is not None:
        note_prework(LAYER_REPLAY)
    return function(x, attention_output, *arrays)


# (module, class) of the covered SwiGLU MLPs.
_MLPS = tuple((module, mlp) for module, _, mlp in DECODER_LAYERS)


def _layer_engages(layer) -> bool:
    """Whether the layer's post-attention norm is ``nn.RMSNorm`` and its MLP
    one of the proven SwiGLU MLP classes (its projections are read at every
    call)."""
    norm, mlp = dict.get(layer, "post_attention_layernorm"), dict.get(layer, "mlp")
    return type(norm) is _RMS_NORM and type(mlp) in defined_classes(_MLPS)


register_attention_families(*(
    AttentionFamily(
        module, layer, _decoder_layer_call, _layer_engages, REFUSAL,
        kind=DECODER_LAYER, restated=PROJECTION_CLASSES,
    )
    for module, layer, _ in DECODER_LAYERS
))
