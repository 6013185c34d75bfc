"""The mlx-lm integration: bit parity on mlx-lm's own models, patch semantics,
fallbacks. Skipped where mlx-lm is not installed (CI installs it)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import types

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

import mlx_lm.models.gated_delta as gated_delta  # noqa: E402
from helpers.bit_parity import assert_bit_identical  # noqa: E402
from helpers.greedy_traces import assert_traces_bit_identical  # noqa: E402
from helpers.threads import run_on_threads  # noqa: E402

from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import _shared  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import gated_delta as fold_module  # noqa: E402
from mlx_dualnorm.commands.shared.generation import (  # noqa: E402
    count_normalize_qk_calls,
    greedy_generate,
)
from helpers.mlx_lm_families import (  # noqa: E402
    build_synthetic_model,
    prompt_token_ids,
)

ORIGINAL = integration.ORIGINAL_NORMALIZE_QK
GATED_DELTA_MODEL_MODULES = (
    "mlx_lm.models.qwen3_next",
    "mlx_lm.models.qwen3_5",
    "mlx_lm.models.kimi_linear",
    "mlx_lm.models.kimi_k3",
    "mlx_lm.models.olmo_hybrid",
    "mlx_lm.models.bailing_moe_v3",
)
GENERATED_TOKENS = 64


@pytest.fixture
def no_fallback(monkeypatch):
    """Fails the test if any call runs mlx-lm's own function."""

    def fail(*arguments):
        raise AssertionError("normalize_qk fell back to mlx-lm's function")

    monkeypatch.setattr(fold_module, "_fall_back", fail)


@pytest.fixture
def fallback_calls(monkeypatch):
    """Counts the calls that run mlx-lm's own function."""
    calls = []
    fall_back = fold_module._fall_back

    def counting(*arguments):
        calls.append(arguments)
        return fall_back(*arguments)

    monkeypatch.setattr(fold_module, "_fall_back", counting)
    return calls


def random_pair(shape, dtype, seed=0, key_shape=None, key_dtype=None):
    query_key, key_key = mx.random.split(mx.random.key(seed))
    queries = mx.random.normal(shape, key=query_key).astype(dtype)
    keys = mx.random.normal(key_shape or shape, key=key_key).astype(key_dtype or dtype)
    return queries, keys


# ---- mlx-lm's real function and the fold ------------------------------------


def test_mlx_lm_normalize_qk_is_the_folded_formula():
    """The fold rests on this body; a new mlx-lm that changes it must fail here."""
    source = inspect.getsource(ORIGINAL)
    assert "rms_eps = eps * inv_scale**2" in source
    assert "(inv_scale**2) * mx.fast.rms_norm(q, None, rms_eps)" in source
    assert "inv_scale * mx.fast.rms_norm(k, None, rms_eps)" in source


def test_drop_in_signature():
    def parameters(function):
        signature = inspect.signature(function, follow_wrapped=False)
        return [(p.name, p.kind, p.default) for p in signature.parameters.values()]

    with integration.patch(mode="compiled"):
        replacement = gated_delta.normalize_qk
    assert parameters(integration.normalize_qk) == parameters(ORIGINAL)
    assert parameters(replacement) == parameters(ORIGINAL)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("width", [2, 7, 128, 256])
@pytest.mark.parametrize(
    "eps, inv_scale", [(1e-6, None), (0.0, 1.0), (1e-5, 0.3)], ids=["gdn", "eps0", "other"]
)
def test_fold_is_bit_identical(no_fallback, dtype, width, eps, inv_scale):
    inv_scale = width**-0.5 if inv_scale is None else inv_scale
    for seed, leading in enumerate([(1, 1, 16), (2, 5, 4), (1, 9, 16)]):
        queries, keys = random_pair(leading + (width,), dtype, seed)
        queries = queries * mx.exp(mx.arange(width) % 11 - 5.0).astype(dtype)
        if seed == 2:  # strided views, as mlx-lm's split/reshape produce
            queries, keys = queries[..., ::-1], mx.swapaxes(mx.swapaxes(keys, 1, 2) + 0, 1, 2)
        expected = ORIGINAL(queries, keys, inv_scale=inv_scale, eps=eps)
        actual = integration.normalize_qk(queries, keys, inv_scale=inv_scale, eps=eps)
        for a, e in zip(actual, expected):
            assert_bit_identical(a, e)


def test_special_values_are_bit_identical(no_fallback):
    queries, keys = random_pair((2, 3, 4, 128), mx.bfloat16)
    position = mx.arange(queries.size).reshape(queries.shape)
    queries = mx.where(position % 31 == 1, mx.array(float("inf"), mx.bfloat16), queries)
    queries = mx.where(position % 37 == 2, mx.array(float("nan"), mx.bfloat16), queries)
    keys = mx.where(position < 256, mx.array(0.0, mx.bfloat16), keys)  # all-zero rows
    for eps in (1e-6, 0.0):
        expected = ORIGINAL(queries, keys, inv_scale=128**-0.5, eps=eps)
        actual = integration.normalize_qk(queries, keys, inv_scale=128**-0.5, eps=eps)
        for a, e in zip(actual, expected):
            assert_bit_identical(a, e)


def test_one_fold_per_key_however_many_calls():
    integration.clear_cache()
    queries, keys = random_pair((1, 1, 16, 128), mx.bfloat16)
    for batch in (1, 2, 1, 3):
        batched = mx.broadcast_to(queries, (batch, 1, 16, 128))
        for _ in range(5):
            integration.normalize_qk(batched, keys, inv_scale=128**-0.5, eps=1e-6)
    assert len(fold_module._folded_norms) == 1


def test_cache_is_thread_safe(no_fallback):
    integration.clear_cache()
    queries, keys = random_pair((1, 1, 16, 128), mx.bfloat16)
    expected = ORIGINAL(queries, keys, inv_scale=0.125, eps=1e-6)
    mx.eval(expected)
    results = []

    def worker():
        for _ in range(10):
            outputs = integration.normalize_qk(queries, keys, inv_scale=0.125, eps=1e-6)
            mx.eval(outputs)
            results.append(outputs)

    run_on_threads(*[worker] * 4, together=True)
    assert len(fold_module._folded_norms) == 1
    assert len(results) == 40
    for outputs in results:
        for a, e in zip(outputs, expected):
            assert_bit_identical(a, e)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "vmap", "compile", "compiled grad"])
def test_transforms_are_bit_identical(transform, dtype):
    """Fine-tuning differentiates normalize_qk; users compile and vmap it.
    The fold's forward is another expression (a weighted rms_norm), so its
    transforms are mlx-lm's own: the same bits on every backend."""
    queries, keys = random_pair((2, 3, 4, 128), dtype)
    cotangent = mx.random.normal(queries.shape, key=mx.random.key(3)).astype(dtype)

    def transformed(normalize_qk):
        def normalized(q, k):
            return list(normalize_qk(q, k, inv_scale=128**-0.5, eps=1e-6))

        def loss(q, k):
            a, b = normalized(q, k)
            return ((a * cotangent).sum() + (b * cotangent * cotangent).sum()).astype(mx.float32)

        if transform == "grad":
            return mx.grad(loss, argnums=(0, 1))(queries, keys)
        if transform == "compiled grad":
            return mx.compile(mx.grad(loss, argnums=(0, 1)))(queries, keys)
        if transform == "vjp":
            return mx.vjp(normalized, [queries, keys], [cotangent, cotangent * 2])[1]
        if transform == "jvp":
            return mx.jvp(normalized, [queries, keys], [cotangent, cotangent * 3])[1]
        if transform == "vmap":
            return mx.vmap(normalized)(queries, keys)
        return mx.compile(normalized)(queries, keys)

    for a, e in zip(transformed(integration.normalize_qk), transformed(ORIGINAL)):
        assert_bit_identical(a, e)


# ---- Fallbacks ----------------------------------------------------------------


def run_both(queries, keys, inv_scale, eps):
    """(result or exception type) of mlx-lm's function and of ours."""

    def outcome(function):
        try:
            result = function(queries, keys, inv_scale=inv_scale, eps=eps)
            mx.eval(result)
            return result
        except Exception as error:
            return type(error)

    return outcome(ORIGINAL), outcome(integration.normalize_qk)


def assert_same_outcome(expected, actual):
    if isinstance(expected, type):
        assert actual is expected
    else:
        for a, e in zip(actual, expected):
            if isinstance(e, mx.array):
                assert_bit_identical(a, e)
            else:  # a numpy inv_scale makes numpy results: same type, dtype, shape, bytes
                assert type(a) is type(e) and a.dtype == e.dtype and a.shape == e.shape
                assert np.asarray(a).tobytes() == np.asarray(e).tobytes()


def _pair(shape=(2, 64), dtype=mx.float32, **options):
    return random_pair(shape, dtype, **options)


# name -> (queries, keys, inv_scale, eps), built when the test runs
FALLBACK_CASES = {
    "mixed_dtypes": lambda: (*_pair(key_dtype=mx.bfloat16), 0.125, 1e-6),
    "mixed_widths": lambda: (*_pair(key_shape=(2, 32)), 0.125, 1e-6),
    "width_1": lambda: (*_pair((5, 1)), 1.0, 1e-6),
    "width_1_rank_4": lambda: (*_pair((1, 1, 16, 1), mx.bfloat16), 1.0, 1e-6),
    "width_0": lambda: (*_pair((2, 0)), 0.5, 1e-6),
    "float64": lambda: (*_pair(dtype=mx.float64), 0.125, 1e-6),
    "int32": lambda: (mx.ones((2, 64), mx.int32), mx.ones((2, 64), mx.int32), 0.125, 1e-6),
    "scalar_input": lambda: (mx.array(1.0), mx.array(1.0), 0.125, 1e-6),
    "numpy_inputs": lambda: (np.ones((2, 64), "float32"), np.ones((2, 64), "float32"), 0.125, 1e-6),
    "array_inv_scale": lambda: (*_pair(dtype=mx.bfloat16), mx.array(0.125), 1e-6),
    "numpy_inv_scale": lambda: (*_pair(), np.float64(0.125), 1e-6),
    "bool_inv_scale": lambda: (*_pair(), True, 1e-6),
    "zero_inv_scale": lambda: (*_pair(), 0.0, 1e-6),
    "negative_zero_inv_scale": lambda: (*_pair(), -0.0, 1e-6),
    "negative_inv_scale": lambda: (*_pair(), -0.125, 1e-6),
    "nan_inv_scale": lambda: (*_pair(), float("nan"), 1e-6),
    "huge_inv_scale": lambda: (*_pair(), 1e200, 1e-6),
    "negative_eps": lambda: (*_pair(), 0.125, -1e-3),
    "infinite_eps": lambda: (*_pair(), 0.125, float("inf")),
    "eps_beyond_float32": lambda: (*_pair(), 1.0, 1e39),
}


def _fallback_case_parameters():
    for name in sorted(FALLBACK_CASES):
        # mlx-lm's own function (the reference here) runs MLX's CUDA
        # RMSNorm, which divides by the width: SIGFPE for width 0 on a GPU.
        on_gpu = mx.default_device() == mx.gpu
        marks = []
        if on_gpu and name == "width_0":
            marks = [pytest.mark.skip(reason="MLX 0.32.4 CUDA rms_norm: SIGFPE at width 0")]
        if on_gpu and name == "float64":
            marks = [pytest.mark.skip(reason="MLX has no float64 on the GPU")]
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("case", list(_fallback_case_parameters()))
def test_unsupported_inputs_run_mlx_lm_function(fallback_calls, case):
    queries, keys, inv_scale, eps = FALLBACK_CASES[case]()
    expected, actual = run_both(queries, keys, inv_scale, eps)
    assert_same_outcome(expected, actual)
    assert fallback_calls, "the call did not fall back"


def test_a_raising_fold_falls_back(monkeypatch, fallback_calls):
    def broken(self, queries, keys):
        raise RuntimeError("broken fold")

    queries, keys = random_pair((1, 1, 16, 128), mx.bfloat16)
    integration.normalize_qk(queries, keys, inv_scale=128**-0.5, eps=1e-6)
    monkeypatch.setattr(fold_module._FoldedScaleNorm, "__call__", broken)
    expected, actual = run_both(queries, keys, 128**-0.5, 1e-6)
    assert_same_outcome(expected, actual)
    assert len(fallback_calls) == 1


def test_a_fold_failing_its_probe_warns_and_falls_back(monkeypatch, fallback_calls):
    """A fold that would change results is never used."""
    integration.clear_cache()
    wrong_epsilon = fold_module._new_dual_head_norm
    monkeypatch.setattr(
        fold_module, "_new_dual_head_norm", lambda rms_eps, mode: wrong_epsilon(0.25, mode)
    )
    queries, keys = random_pair((1, 1, 16, 128), mx.bfloat16)
    with pytest.warns(RuntimeWarning, match="not bit-identical"):
        expected, actual = run_both(queries, keys, 128**-0.5, 1e-6)
    assert_same_outcome(expected, actual)
    assert fallback_calls
    integration.clear_cache()


def test_nan_scalars_never_reach_the_cache(fallback_calls):
    integration.clear_cache()
    queries, keys = random_pair((2, 64), mx.float32)
    for _ in range(3):
        expected, actual = run_both(queries, keys, float("nan"), 1e-6)
        assert_same_outcome(expected, actual)
        expected, actual = run_both(queries, keys, 0.125, float("nan"))
        assert_same_outcome(expected, actual)
    assert not fold_module._folded_norms


def test_cache_is_bounded(monkeypatch, fallback_calls):
    integration.clear_cache()
    monkeypatch.setattr(_shared, "MAX_CACHED_OBJECTS", 2)
    queries, keys = random_pair((2, 64), mx.float32)
    for inv_scale in (0.5, 0.25, 0.125):
        expected, actual = run_both(queries, keys, inv_scale, 1e-6)
        assert_same_outcome(expected, actual)
    assert len(fold_module._folded_norms) == 2
    assert len(fallback_calls) == 1
    integration.clear_cache()


# ---- Patch and unpatch ----------------------------------------------------------

# What patch() installs in mlx-lm (default mode): not the drop-in itself,
# which folds whether patched or not, but a function that reads the patch's
# state at each call.
PATCHED = fold_module._replacement_for(None)


@pytest.fixture
def model_modules():
    return [importlib.import_module(name) for name in GATED_DELTA_MODEL_MODULES]


def installed(modules):
    return {module.__name__: module.normalize_qk for module in [gated_delta, *modules]}


def test_patch_replaces_every_loaded_copy_and_unpatch_restores(model_modules):
    integration.patch()
    assert integration.is_patched()
    assert set(installed(model_modules).values()) == {PATCHED}
    integration.unpatch()
    assert not integration.is_patched()
    assert set(installed(model_modules).values()) == {ORIGINAL}


def test_patch_and_unpatch_are_idempotent(model_modules):
    integration.unpatch()
    assert set(installed(model_modules).values()) == {ORIGINAL}
    integration.patch()
    integration.patch()
    assert set(installed(model_modules).values()) == {PATCHED}
    integration.unpatch()
    assert set(installed(model_modules).values()) == {ORIGINAL}


def test_context_managers_nest(model_modules):
    with integration.patch() as outer:
        assert outer.patched and integration.is_patched()
        with integration.patch():
            assert gated_delta.normalize_qk is PATCHED
        assert integration.is_patched()
        with integration.unpatch():
            assert set(installed(model_modules).values()) == {ORIGINAL}
        assert set(installed(model_modules).values()) == {PATCHED}
    assert not integration.is_patched()
    assert set(installed(model_modules).values()) == {ORIGINAL}


def test_a_permanent_patch_survives_a_block():
    integration.patch()
    with integration.patch():
        pass
    assert integration.is_patched()
    assert gated_delta.normalize_qk is PATCHED


def test_modules_outside_mlx_lm_and_imported_later(monkeypatch):
    foreign = types.ModuleType("someone_else")
    foreign.normalize_qk = ORIGINAL
    holder = types.ModuleType("mlx_lm.models._test_holder")
    holder.normalize_qk = ORIGINAL
    monkeypatch.setitem(sys.modules, "someone_else", foreign)
    monkeypatch.setitem(sys.modules, "mlx_lm.models._test_holder", holder)
    with integration.patch():
        late = types.ModuleType("mlx_lm.models._test_late")
        exec("from mlx_lm.models.gated_delta import normalize_qk", late.__dict__)
        monkeypatch.setitem(sys.modules, "mlx_lm.models._test_late", late)
        assert holder.normalize_qk is PATCHED
        assert late.normalize_qk is PATCHED
        assert foreign.normalize_qk is ORIGINAL
    assert holder.normalize_qk is ORIGINAL and late.normalize_qk is ORIGINAL


def test_mode_is_passed_through(no_fallback):
    integration.clear_cache()
    with integration.patch(mode="compiled"):
        replacement = gated_delta.normalize_qk
        assert replacement.mlx_dualnorm_mode == "compiled"
        queries, keys = random_pair((1, 1, 16, 128), mx.bfloat16)
        expected = ORIGINAL(queries, keys, inv_scale=128**-0.5, eps=1e-6)
        for a, e in zip(replacement(queries, keys, inv_scale=128**-0.5, eps=1e-6), expected):
            assert_bit_identical(a, e)
    (fold,) = fold_module._folded_norms.values()
    assert fold.dual_head_norm.mode == "compiled"
    with integration.patch(mode="compiled"):
        assert gated_delta.normalize_qk is replacement  # one function per mode


def test_a_mode_that_cannot_run_raises_and_changes_nothing():
    with pytest.raises(ValueError, match="mode"):
        integration.patch(mode="no-such-mode")
    assert not integration.is_patched()
    assert gated_delta.normalize_qk is ORIGINAL


def test_importing_mlx_dualnorm_does_not_import_mlx_lm():
    probe = (
        "import sys, mlx_dualnorm, mlx_dualnorm.integrations\n"
        "loaded = [m for m in sys.modules if m == 'mlx_lm' or m.startswith('mlx_lm.')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)


# ---- Greedy generation on mlx-lm's own models -------------------------------------


@pytest.mark.parametrize(
    "model_type, dtype",
    [("qwen3_next", mx.float32), ("qwen3_5", mx.bfloat16)],
    ids=["qwen3_next-float32", "qwen3_5-bfloat16"],
)
def test_greedy_generation_is_bit_identical(monkeypatch, model_type, dtype):
    model = build_synthetic_model(model_type, dtype=dtype)
    gated_delta_layers = [layer.linear_attn for layer in model.layers if layer.is_linear]
    assert len(gated_delta_layers) == 3
    assert {(layer.num_k_heads, layer.head_k_dim) for layer in gated_delta_layers} == {(16, 128)}
    prompt = prompt_token_ids(512)

    shapes = []
    fold_call = fold_module._FoldedScaleNorm.__call__

    def recording_fold_call(self, queries, keys):
        shapes.append((queries.shape, queries.dtype))
        return fold_call(self, queries, keys)

    def fail(*arguments):
        raise AssertionError("normalize_qk fell back to mlx-lm's function")

    reference = greedy_generate(model, prompt, GENERATED_TOKENS)
    monkeypatch.setattr(fold_module, "_fall_back", fail)  # every call must fold
    monkeypatch.setattr(fold_module._FoldedScaleNorm, "__call__", recording_fold_call)
    with integration.patch(), count_normalize_qk_calls() as counts:
        patched = greedy_generate(model, prompt, GENERATED_TOKENS)

    assert len(set(reference.token_ids)) > 8, "a degenerate model proves little"
    assert_traces_bit_identical(reference, patched, steps=GENERATED_TOKENS + 1)
    # 3 gated-delta layers x (prompt chunk + GENERATED_TOKENS + 1 steps)
    assert counts.calls == counts.folded == 3 * (GENERATED_TOKENS + 2)
    assert ((1, 1, 16, 128), dtype) in shapes  # the real decode shape
