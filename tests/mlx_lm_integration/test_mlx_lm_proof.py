"""The patch replaces only code it has proven: code that differs from what
it was tested against (a newer mlx-lm, a class the program changed, a
monkeypatched norm, RoPE or cache) runs as it is, bit for bit; copies and
pickles of a patched model are those of an unpatched one; the one-call
cache write updates the array objects the cache holds, as mlx-lm's item
assignment does.

Every comparison is against mlx-lm running the same (changed) code
unpatched, bit for bit.
"""

from __future__ import annotations

import collections
import copy
import os
import pathlib
import pickle
import shutil
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

import mlx_lm  # noqa: E402
from helpers.bit_parity import assert_bit_identical  # noqa: E402
from helpers.greedy_traces import assert_traces_bit_identical  # noqa: E402
from helpers.mlx_lm_patch import count_applied_calls, forget_proofs  # noqa: E402
from helpers.isolated_process import TESTS_DIR, describe, run_python  # noqa: E402
from mlx_lm.models import cache as cache_module  # noqa: E402
from mlx_lm.models import qwen3  # noqa: E402

from mlx_dualnorm import CompiledDualHeadNormRope  # noqa: E402
from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import cache_update, engine, qwen3 as qwen3_shape  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.engagement import is_engaged_layer  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.state import STATE  # noqa: E402
from mlx_dualnorm.commands.shared.generation import greedy_generate  # noqa: E402
from helpers.mlx_lm_families import build_synthetic_model, prompt_token_ids  # noqa: E402

INSTALLED_MLX_LM = pathlib.Path(mlx_lm.__file__).parent
PROMPT = prompt_token_ids(512, 12)
TOKENS = 6  # greedy_generate runs the model TOKENS + 2 times: the prompt, TOKENS + 1 steps


@pytest.fixture
def proofs_forgotten():
    """Cached proofs dropped before and after: the test changes live code."""
    forget_proofs()
    yield
    forget_proofs()


@pytest.fixture
def package_calls(monkeypatch):
    """Calls of qwen3-shaped layers that took the package's prework."""
    counts = {"package": 0}
    count_applied_calls(monkeypatch, qwen3_shape, "_prework_and_cache_update", counts, "package")
    return counts


@pytest.fixture
def one_call_writes(monkeypatch):
    counts = {"one_call": 0}
    count_applied_calls(monkeypatch, cache_update, "_written_in_one_call", counts, "one_call")
    return counts


def patched_quietly():
    """patch(), its one warning per process (about what this test changed)
    not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return integration.patch()


# ---- A newer release: a copy of mlx-lm with changed classes, first on the path --

# (file, line as mlx-lm 0.32.2 has it, the line the "newer release" has)
CHANGED_LINES = (
    ("models/qwen3.py",
     "queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)",
     "queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x) * 0.5"),
    ("models/olmo2.py",
     "queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)",
     "queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x) * 0.5"),
    ("models/cache.py",
     "self.values[..., prev : self.offset, :] = values",
     "self.values[..., prev : self.offset, :] = values * 0.5"),
    ("models/gemma3_text.py",
     "return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)",
     "return mx.fast.rms_norm(x, 2.0 + self.weight, self.eps)"),
)

NEWER_RELEASE = """
    import warnings
    import mlx_lm
    from mlx_dualnorm.integrations import mlx_lm as integration
    from mlx_dualnorm.integrations.mlx_lm.engagement import layer_engagement
    from mlx_dualnorm.commands.shared.generation import compare_traces, greedy_generate
    from helpers.mlx_lm_families import build_synthetic_model, prompt_token_ids

    print("MLX_LM_FROM", mlx_lm.__file__)
    prompt = prompt_token_ids(256, 9)
    models = {name: build_synthetic_model(name)
              for name in ("qwen3", "olmo2", "gemma3_text", "qwen3_moe", "qwen3_next")}
    references = {name: greedy_generate(model, prompt, 5) for name, model in models.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        integration.patch()
    for warning in caught:
        print("WARNING", warning.message)
    print("END")
    for name, model in models.items():
        patched = greedy_generate(model, prompt, 5)
        record = layer_engagement(model)
        print("MODEL", name, "IDENTICAL", compare_traces(references[name], patched).identical,
              "ENGAGED", record.engaged_layers, "LEFT", record.left_layers)
    print("SUMMARY", integration.report().summary())
    integration.unpatch()
"""


def test_a_newer_release_runs_what_changed_as_shipped_and_patches_the_rest(tmp_path):
    copied = tmp_path / "newer" / "mlx_lm"
    shutil.copytree(INSTALLED_MLX_LM, copied, ignore=shutil.ignore_patterns("__pycache__"))
    for relative, old, new in CHANGED_LINES:
        path = copied / relative
        text = path.read_text()
        assert text.count(old) == 1, f"{relative}: the line to change is not there once"
        path.write_text(text.replace(old, new))
    process = run_python(
        NEWER_RELEASE,
        env_overrides={"PYTHONPATH": os.pathsep.join(
            [str(TESTS_DIR), str(copied.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
        )},
        timeout_s=600,
    )
    assert process.returncode == 0, describe(process)
    output = process.stdout
    assert f"MLX_LM_FROM {copied}" in output, describe(process)
    for name in ("qwen3", "olmo2", "gemma3_text", "qwen3_moe", "qwen3_next"):
        assert f"MODEL {name} IDENTICAL True" in output, describe(process)
    lines = {line.split()[1]: line for line in output.splitlines() if line.startswith("MODEL ")}
    # The changed attention classes and the layers of the changed norm: mlx-lm's code.
    assert "ENGAGED 0" in lines["qwen3"] and "ENGAGED 0" in lines["olmo2"]
    assert "ENGAGED 0" in lines["gemma3_text"]
    # What did not change keeps the package's path.
    assert "ENGAGED 0" not in lines["qwen3_moe"] and "ENGAGED 0" not in lines["qwen3_next"]
    warning = output.split("WARNING ", 1)[1].split("\nEND", 1)[0]
    assert output.count("WARNING ") == 1, describe(process)
    named = {line.strip().split(": ", 1)[0]: line for line in warning.splitlines()[1:]}
    assert set(named) == {
        "mlx_lm.models.qwen3.Attention", "mlx_lm.models.olmo2.Attention",
        "mlx_lm.models.cache.KVCache", "mlx_lm.models.gemma3_text.RMSNorm",
    }, warning
    assert "update_and_fetch" in named["mlx_lm.models.cache.KVCache"]
    assert "1 class" not in warning and "0.5" not in warning  # no source text


# ---- The program's own changes ------------------------------------------------------


def qwen3_model():
    return build_synthetic_model("qwen3")


def test_an_attention_call_replaced_before_patch_is_kept(monkeypatch, proofs_forgotten,
                                                         package_calls):
    monkeypatch.setattr(STATE, "warned_unproven", False)  # this test's own warning
    model = qwen3_model()
    own_call = qwen3.Attention.__call__

    def scaled_input(self, x, mask=None, cache=None):
        return own_call(self, x * 1.5, mask, cache)

    monkeypatch.setattr(qwen3.Attention, "__call__", scaled_input)
    reference = greedy_generate(model, PROMPT, TOKENS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        integration.patch()
    patched = greedy_generate(model, PROMPT, TOKENS)
    assert qwen3.Attention.__call__ is scaled_input
    integration.unpatch()
    assert qwen3.Attention.__call__ is scaled_input
    assert_traces_bit_identical(reference, patched)
    assert package_calls["package"] == 0
    assert [str(w.message).count("mlx_lm.models.qwen3.Attention: __call__") for w in caught] == [1]


def test_an_attention_call_replaced_after_a_patched_forward_runs_and_stays(monkeypatch):
    model = qwen3_model()
    own_call = qwen3.Attention.__call__
    calls = collections.Counter()

    def counted(self, x, mask=None, cache=None):
        calls["user"] += 1
        return own_call(self, x, mask, cache)

    reference = greedy_generate(model, PROMPT, TOKENS)
    integration.patch()
    greedy_generate(model, PROMPT, 1)  # every layer decided
    monkeypatch.setattr(qwen3.Attention, "__call__", counted)
    patched = greedy_generate(model, PROMPT, TOKENS)
    assert calls["user"] == len(model.layers) * (TOKENS + 2)
    integration.unpatch()
    assert qwen3.Attention.__call__ is counted  # unpatch() keeps the user's function
    assert_traces_bit_identical(reference, patched)


@pytest.mark.parametrize("part", ["RMSNorm", "RoPE"])
def test_a_monkeypatched_norm_or_rope_runs_in_every_layer(monkeypatch, proofs_forgotten, part,
                                                          package_calls):
    """A process-wide change of nn.RMSNorm's or nn.RoPE's __call__: the
    patched layers call it as often as mlx-lm's own code does, and the
    bits are those of that changed code."""
    model = qwen3_model()
    part_class = getattr(nn, part)
    own_call = part_class.__call__
    calls = collections.Counter()

    def instrumented(self, *arguments, **keywords):
        calls[part] += 1
        return own_call(self, *arguments, **keywords) * 1.0625

    monkeypatch.setattr(part_class, "__call__", instrumented)
    reference = greedy_generate(model, PROMPT, TOKENS)
    unpatched_calls = calls[part]
    calls.clear()
    patched_quietly()
    patched = greedy_generate(model, PROMPT, TOKENS)
    assert calls[part] == unpatched_calls > 0
    assert package_calls["package"] == 0
    assert_traces_bit_identical(reference, patched)


def test_a_monkeypatched_cache_update_runs_at_every_step(monkeypatch, proofs_forgotten,
                                                         one_call_writes):
    model = qwen3_model()
    own_update = cache_module.KVCache.update_and_fetch
    calls = collections.Counter()

    def instrumented(self, keys, values):
        calls["update"] += 1
        return own_update(self, keys, values * 0.75)

    monkeypatch.setattr(cache_module.KVCache, "update_and_fetch", instrumented)
    reference = greedy_generate(model, PROMPT, TOKENS)
    unpatched_calls = calls["update"]
    calls.clear()
    patched_quietly()
    patched = greedy_generate(model, PROMPT, TOKENS)
    assert calls["update"] == unpatched_calls == len(model.layers) * (TOKENS + 2)
    assert one_call_writes["one_call"] == 0
    assert_traces_bit_identical(reference, patched)


def test_a_cache_update_monkeypatched_while_patched_is_seen_at_the_next_step(monkeypatch,
                                                                            one_call_writes):
    model = qwen3_model()
    integration.patch()
    greedy_generate(model, PROMPT, 2)
    assert one_call_writes["one_call"] > 0
    one_call_writes["one_call"] = 0
    own_update = cache_module.KVCache.update_and_fetch
    calls = collections.Counter()

    def counted(self, keys, values):
        calls["update"] += 1
        return own_update(self, keys, values)

    monkeypatch.setattr(cache_module.KVCache, "update_and_fetch", counted)
    greedy_generate(model, PROMPT, 2)
    assert calls["update"] == len(model.layers) * 4  # the prompt and three steps
    assert one_call_writes["one_call"] == 0


def scaled_rms_norm(self, x):
    return mx.fast.rms_norm(x, self["weight"], self.eps) * 1.0625


def decode(model, caches, steps=4):
    """A prompt, then greedy steps, into ``caches``: the logits."""
    logits = [model(mx.array([[int(t) for t in PROMPT]]), cache=caches)[:, -1, :]]
    for _ in range(steps):
        logits.append(model(mx.argmax(logits[-1], axis=-1)[:, None], cache=caches)[:, -1, :])
    mx.eval(logits)
    return logits


def assert_same_logits(actual, expected):
    for actual_step, expected_step in zip(actual, expected):
        assert_bit_identical(actual_step, expected_step)


def test_a_norm_s_code_swapped_after_the_first_patched_call_is_followed_at_the_next_call(
        monkeypatch, proofs_forgotten, package_calls):
    """nn.RMSNorm.__call__'s __code__ swapped (as a reloader does) after the
    layers were decided, with no patch() since: their next call is mlx-lm's
    (the decision tests the function's code at every call), and a later
    patch() says what it left."""
    monkeypatch.setattr(STATE, "warned_unproven", False)
    model = qwen3_model()
    integration.patch()
    greedy_generate(model, PROMPT, 1)
    assert package_calls["package"] > 0
    monkeypatch.setattr(nn.RMSNorm.__call__, "__code__", scaled_rms_norm.__code__)
    package_calls["package"] = 0
    patched = greedy_generate(model, PROMPT, TOKENS)
    assert package_calls["package"] == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        integration.patch()
    assert any("RMSNorm: __call__" in str(warning.message) for warning in caught)
    integration.unpatch()
    assert_traces_bit_identical(greedy_generate(model, PROMPT, TOKENS), patched)
    report_after = integration.report()
    assert report_after.engaged_layers == 0  # the layers were counted again, as left


def test_changed_defaults_are_not_proven(monkeypatch, proofs_forgotten, package_calls):
    """nn.RoPE.__call__'s default offset assigned (a call without a cache
    rotates at it): the source's literal is no longer the function's."""
    model = qwen3_model()
    tokens = mx.array([[int(t) for t in PROMPT]])
    monkeypatch.setattr(nn.RoPE.__call__, "__defaults__", (5,))
    reference = model(tokens)
    with patched_quietly():
        patched = model(tokens)
    assert package_calls["package"] == 0
    assert_bit_identical(patched, reference)


def test_a_replaced_mlx_fast_function_keeps_every_layer_on_its_own_code(monkeypatch,
                                                                       package_calls):
    model = qwen3_model()
    own_rms_norm = mx.fast.rms_norm
    calls = collections.Counter()

    def counted_rms_norm(*arguments, **keywords):
        calls["rms_norm"] += 1
        return own_rms_norm(*arguments, **keywords)

    monkeypatch.setattr(mx.fast, "rms_norm", counted_rms_norm)
    reference = greedy_generate(model, PROMPT, TOKENS)
    unpatched_calls, calls["rms_norm"] = calls["rms_norm"], 0
    patched_quietly()
    patched = greedy_generate(model, PROMPT, TOKENS)
    assert calls["rms_norm"] == unpatched_calls > 0
    assert package_calls["package"] == 0
    assert_traces_bit_identical(reference, patched)


def test_a_cache_object_s_own_update_runs(one_call_writes):
    """update_and_fetch set on a cache object (not its class): the object's
    own method runs at every step, as unpatched."""
    model = qwen3_model()
    calls = collections.Counter()

    def caches_with_own_update():
        caches = [cache_module.KVCache() for _ in model.layers]
        for cache in caches:
            own = cache.update_and_fetch

            def counted(keys, values, own=own):
                calls["update"] += 1
                return own(keys, values * 0.5)

            cache.update_and_fetch = counted
        return caches

    reference = decode(model, caches_with_own_update())
    unpatched_calls, calls["update"] = calls["update"], 0
    with integration.patch():
        patched = decode(model, caches_with_own_update())
    assert calls["update"] == unpatched_calls == len(model.layers) * 5
    assert one_call_writes["one_call"] == 0
    assert_same_logits(patched, reference)


def test_a_dispatcher_put_back_after_unpatch_runs_the_class_s_own_code(package_calls):
    model = qwen3_model()
    reference = greedy_generate(model, PROMPT, TOKENS)
    integration.patch()
    saved = qwen3.Attention.__call__
    integration.unpatch()
    own = qwen3.Attention.__call__
    try:
        qwen3.Attention.__call__ = saved
        put_back = greedy_generate(model, PROMPT, TOKENS)
        assert package_calls["package"] == 0 and not STATE.decisions
        integration.patch()  # and a patch then installs over it as over mlx-lm's
        assert engine.is_installed(qwen3.Attention)
        integration.unpatch()
        assert qwen3.Attention.__call__ is own
    finally:
        qwen3.Attention.__call__ = own
    assert_traces_bit_identical(reference, put_back)


def test_a_user_s_wrapper_of_the_patched_normalize_qk_stays_after_unpatch():
    import functools

    import mlx_lm.models.gated_delta as gated_delta

    integration.patch()
    patched_function = gated_delta.normalize_qk

    @functools.wraps(patched_function)
    def wrapper(*arguments, **keywords):
        return patched_function(*arguments, **keywords)

    own = integration.ORIGINAL_NORMALIZE_QK
    try:
        gated_delta.normalize_qk = wrapper
        integration.unpatch()
        assert gated_delta.normalize_qk is wrapper
    finally:
        gated_delta.normalize_qk = own


# ---- Copies and pickles ------------------------------------------------------------


def test_a_deep_copy_made_while_patched_runs_mlx_lms_code_once_unpatched(package_calls):
    model = qwen3_model()
    reference = greedy_generate(model, PROMPT, TOKENS)
    integration.patch()
    greedy_generate(model, PROMPT, 2)
    assert all(is_engaged_layer(layer.self_attn) for layer in model.layers)
    duplicate = copy.deepcopy(model)
    integration.unpatch()
    package_calls["package"] = 0
    unpatched_copy = greedy_generate(duplicate, PROMPT, TOKENS)
    assert package_calls["package"] == 0
    assert not integration.is_patched()
    assert_traces_bit_identical(reference, unpatched_copy)
    integration.patch()  # and patched again, the copy is decided at its own first call
    patched_copy = greedy_generate(duplicate, PROMPT, TOKENS)
    assert package_calls["package"] == len(duplicate.layers) * (TOKENS + 2)
    assert_traces_bit_identical(reference, patched_copy)


def test_a_patched_model_pickles_as_an_unpatched_one():
    model = qwen3_model()
    unpatched_bytes = pickle.dumps(model)
    reference = greedy_generate(model, PROMPT, TOKENS)
    integration.patch()
    greedy_generate(model, PROMPT, 2)
    patched_bytes = pickle.dumps(model)
    integration.unpatch()
    assert patched_bytes == unpatched_bytes
    restored = pickle.loads(patched_bytes)
    assert_traces_bit_identical(reference, greedy_generate(restored, PROMPT, TOKENS))


# ---- The cache's own array objects -------------------------------------------------


def batch_prompt(lengths, vocabulary=512):
    """Left-padded prompts and their padding, as batch_generate makes them."""
    width = max(lengths)
    rows = [[0] * (width - length) + [int(t) for t in prompt_token_ids(vocabulary, 3 + length)[
        :length]] for length in lengths]
    return mx.array(rows), [width - length for length in lengths]


def make_caches(kind, model, padding):
    layers = len(model.layers)
    if kind == "KVCache":
        return [cache_module.KVCache() for _ in range(layers)]
    if kind == "RotatingKVCache":
        return [cache_module.RotatingKVCache(max_size=16) for _ in range(layers)]
    if kind == "BatchKVCache":
        return [cache_module.BatchKVCache(padding) for _ in range(layers)]
    return [cache_module.BatchRotatingKVCache(16, padding) for _ in range(layers)]


CACHE_KINDS = ("KVCache", "RotatingKVCache", "BatchKVCache", "BatchRotatingKVCache")


def held_and_forked_run(model, kind):
    """A prompt, then decode steps while code holds the caches' arrays and
    state from before each step, and a fork of the caches (``copy.copy``:
    the same array objects) decodes in turn with the original: the logits,
    and every array held, as evaluated arrays."""
    batched = kind.startswith("Batch")
    prompt, padding = batch_prompt([9, 6] if batched else [9])
    caches = make_caches(kind, model, padding)
    logits = [model(prompt, cache=caches)[:, -1, :]]
    forks = [copy.copy(cache) for cache in caches]
    held = []
    token = mx.argmax(logits[-1], axis=-1)[:, None]
    for step in range(12):
        held.append([(cache.keys, cache.values) for cache in caches])
        held.append([tuple(cache.state[:2]) for cache in caches])
        which = caches if step % 2 == 0 else forks
        logits.append(model(token, cache=which)[:, -1, :])
        token = (mx.argmax(logits[-1], axis=-1)[:, None] + step) % 512
        mx.eval(logits, held)
    return logits, held


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_holders_of_the_caches_arrays_see_what_they_see_unpatched(kind, one_call_writes):
    model = qwen3_model()
    reference_logits, reference_held = held_and_forked_run(model, kind)
    with integration.patch():
        patched_logits, patched_held = held_and_forked_run(model, kind)
    assert one_call_writes["one_call"] > 0, "the one-call write never ran: nothing was proven"
    for actual, expected in zip(patched_logits, reference_logits):
        assert_bit_identical(actual, expected)
    for actual_step, expected_step in zip(patched_held, reference_held):
        for actual_pair, expected_pair in zip(actual_step, expected_step):
            for actual, expected in zip(actual_pair, expected_pair):
                assert_bit_identical(actual, expected)


# ---- The call's errors, and the report ----------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"queries": "not an array"},
        {"values": object()},
        {"key_cache": [1.5]},
        {"offset": 1.5},
        {"offset": "position"},
        {"freqs": [1.0, 2.0]},
        {"stream": "gpu, please"},
    ],
)
def test_every_error_of_apply_with_cache_names_that_call(change):
    norm_rope = CompiledDualHeadNormRope(1e-6, 8, base=None if "freqs" in change else 10_000.0)
    arguments = dict(
        queries=mx.zeros((1, 1, 2, 8)), keys=mx.zeros((1, 1, 1, 8)),
        values=mx.zeros((1, 1, 1, 8)), key_cache=mx.zeros((1, 1, 4, 8)),
        value_cache=mx.zeros((1, 1, 4, 8)), offset=0, write_offset=0,
    )
    arguments.update(change)
    positional = [arguments.pop(name) for name in ("queries", "keys", "values")]
    with pytest.raises((TypeError, ValueError)) as raised:
        norm_rope.apply_with_cache(*positional, **arguments)
    assert str(raised.value).startswith("[dual_head_norm_rope_with_cache] "), raised.value


def test_the_report_says_what_the_patch_engaged():
    model = qwen3_model()
    integration.patch()
    greedy_generate(model, PROMPT, TOKENS)
    report = integration.report()
    entry = next(e for e in report.classes if e.name == "mlx_lm.models.qwen3.Attention")
    assert report.patched and entry.patched and not entry.unproven
    assert entry.engaged_layers == len(model.layers) and entry.left_layers == {}
    assert entry.calls == len(model.layers) * (TOKENS + 2) and entry.fallbacks == 0
    summary = report.summary()
    assert "\n" not in summary
    assert summary.startswith(f"mlx_dualnorm: {report.engaged_layers} attention layers engaged")
    assert "qwen3.Attention" in summary
    integration.unpatch()
    assert integration.report().summary().startswith("mlx_dualnorm: not patched")
