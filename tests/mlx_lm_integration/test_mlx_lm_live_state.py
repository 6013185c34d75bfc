"""What the original reads at each call, the patch reads at each call;
patch() all or nothing; blocks across threads; the program's own classes
and references that outlive the patch. Each test changes something a
program may change, then holds the patched run to the unpatched one."""

from __future__ import annotations

import sys
import threading
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")

from mlx_lm.models import cache as cache_module  # noqa: E402
from mlx_lm.models import gated_delta, qwen3  # noqa: E402

from helpers.greedy_traces import assert_traces_bit_identical, greedy_logits  # noqa: E402
from helpers.mlx_lm_patch import forget_proofs  # noqa: E402
from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import engine, registry  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import gated_delta as fold_module  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.state import STATE  # noqa: E402
from mlx_dualnorm.commands.shared.generation import greedy_generate  # noqa: E402
from helpers.mlx_lm_families import build_synthetic_model, prompt_token_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

PROMPT = prompt_token_ids(512, 12)
TOKENS = 6


@pytest.fixture
def proofs_forgotten():
    forget_proofs()
    yield
    forget_proofs()


def assert_patched_run_is_unpatched_run(model, tokens=TOKENS):
    """Greedy decode of ``model``: unpatched, then patched (the patch left on
    as the test found it), the same tokens and logits."""
    reference = greedy_generate(model, PROMPT, tokens)
    with integration.patch():
        patched = greedy_generate(model, PROMPT, tokens)
    assert_traces_bit_identical(reference, patched)


def nothing_installed() -> bool:
    return (
        not integration.is_patched()
        and not engine.patched_classes()
        and gated_delta.normalize_qk is integration.ORIGINAL_NORMALIZE_QK
        and qwen3.Attention.__call__ is engine.unpatched_function(qwen3.Attention, "__call__")
    )


# ---- patch() is all or nothing ---------------------------------------------------------


def olmo2_call_wrapped(monkeypatch):
    """olmo2's attention __call__ replaced by a wrapper: a class left
    unproven, so patch() warns."""
    from mlx_lm.models import olmo2

    own_call = olmo2.Attention.__call__

    def wrapped(self, *arguments, **keywords):
        return own_call(self, *arguments, **keywords)

    monkeypatch.setattr(olmo2.Attention, "__call__", wrapped)


def test_a_warning_raised_as_an_error_leaves_nothing_installed(monkeypatch):
    olmo2_call_wrapped(monkeypatch)
    monkeypatch.setattr(STATE, "warned_unproven", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match=r"mlx_lm\.models\.olmo2\.Attention"):
            with integration.patch():
                pytest.fail("the block ran")
    assert nothing_installed()
    model = build_synthetic_model("qwen3")
    greedy_generate(model, PROMPT, 2)
    assert integration.report().engaged_layers == 0
    # The warning was not given: the next patch() gives it.
    with pytest.warns(RuntimeWarning, match=r"mlx_lm\.models\.olmo2\.Attention"):
        integration.patch()
    assert integration.is_patched()


def test_a_model_module_that_raises_on_import_is_left_alone_and_named(
        monkeypatch, tmp_path):
    (tmp_path / "needs_a_newer_mlx.py").write_text(
        "import mlx.core as mx\nmx.some_function_of_a_newer_mlx\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    family = registry.AttentionFamily(
        "needs_a_newer_mlx", "Attention", lambda self, x: x, lambda layer: True
    )
    monkeypatch.setattr(registry, "_attention_families", [*registry.attention_families(), family])
    monkeypatch.setattr(STATE, "warned_unproven", False)
    monkeypatch.setattr(STATE, "import_failures", {})
    with pytest.warns(RuntimeWarning) as caught:
        integration.patch()
    message = "\n".join(str(warning.message) for warning in caught)
    assert "needs_a_newer_mlx: does not import (AttributeError" in message
    assert integration.is_patched()
    assert gated_delta.normalize_qk is fold_module._replacement_for(None)
    assert engine.is_installed(qwen3.Attention)
    assert "needs_a_newer_mlx" not in sys.modules


def test_blocks_that_overlap_in_two_threads_leave_it_as_it_was():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with integration.patch():
            first_in.set()
            second_in.wait(30)
        first_out.set()

    def second():
        first_in.wait(30)
        with integration.patch():
            second_in.set()
            first_out.wait(30)
            seen["after the first block"] = integration.is_patched()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {"after the first block": True}
    assert nothing_installed()


def test_a_plain_unpatch_while_another_thread_s_block_is_open_stays():
    inside, unpatched = threading.Event(), threading.Event()

    def block():
        with integration.patch():
            inside.set()
            unpatched.wait(30)

    thread = threading.Thread(target=block)
    thread.start()
    inside.wait(30)
    integration.unpatch()
    unpatched.set()
    thread.join(60)
    assert nothing_installed()


def test_a_mode_of_another_type_or_name_is_refused_clearly():
    with pytest.raises(TypeError, match=r"^\[mlx_lm\.patch\] mode must be None or one of"):
        integration.patch(123)
    with pytest.raises(ValueError, match=r"^\[mlx_lm\.patch\] mode must be None or one of"):
        integration.patch("bogus")
    assert nothing_installed()


# ---- Read at each call what the original reads at each call -------------------------


class ScaledRMSNorm(nn.RMSNorm):
    """A program's own norm: RMSNorm's output scaled."""

    def __call__(self, x):
        return super().__call__(x) * 1.0625


def test_a_norm_class_rebound_after_a_first_patched_model_is_followed(monkeypatch):
    with integration.patch():
        greedy_generate(build_synthetic_model("qwen3"), PROMPT, 2)
    monkeypatch.setattr(nn, "RMSNorm", ScaledRMSNorm)
    model = build_synthetic_model("qwen3")
    assert type(model.layers[0].self_attn.q_norm) is ScaledRMSNorm
    with integration.patch():  # a new patch() changes nothing either
        pass
    assert_patched_run_is_unpatched_run(model)


def test_a_rope_class_rebound_after_a_first_patched_model_is_followed(monkeypatch):
    from mlx_lm.models import rope_utils

    class ScaledLlama3RoPE(rope_utils.Llama3RoPE):
        def __call__(self, x, offset=0):
            return super().__call__(x, offset) * 1.0625

    with integration.patch():
        greedy_generate(build_synthetic_model("apertus-llama3"), PROMPT, 2)
    monkeypatch.setattr(rope_utils, "Llama3RoPE", ScaledLlama3RoPE)
    model = build_synthetic_model("apertus-llama3")
    assert type(model.layers[0].self_attn.rope) is ScaledLlama3RoPE
    assert_patched_run_is_unpatched_run(model)


def scaled_norm_call(self, x):
    return mx.fast.rms_norm(x, self["weight"], self.eps) * 1.0625


def test_a_norm_call_replaced_after_a_patched_step_is_followed_at_the_next_call(monkeypatch):
    model = build_synthetic_model("qwen3")
    integration.patch()
    greedy_generate(model, PROMPT, 2)
    monkeypatch.setattr(nn.RMSNorm, "__call__", scaled_norm_call)  # no patch() since
    patched = greedy_generate(model, PROMPT, TOKENS)
    integration.unpatch()
    assert_traces_bit_identical(greedy_generate(model, PROMPT, TOKENS), patched)
    monkeypatch.undo()
    integration.patch()
    greedy_generate(model, PROMPT, 2)
    assert integration.report().engaged_layers > 0  # restored: decided again, engaged


@pytest.mark.parametrize("replaced", ["before the swap", "after the swap"])
def test_a_norm_swapped_for_another_known_class_with_its_call_replaced_is_followed(
        monkeypatch, replaced):
    # gemma3_text's layers are decided on their own RMSNorm class; nn.RMSNorm,
    # a class the replacement computes too, is in none of their checks.
    model = build_synthetic_model("gemma3_text")
    integration.patch()
    greedy_generate(model, PROMPT, 2)
    assert integration.report().engaged_layers > 0
    if replaced == "before the swap":
        monkeypatch.setattr(nn.RMSNorm, "__call__", scaled_norm_call)
    for layer in attention_layers(model):
        for name in ("q_norm", "k_norm"):
            own = getattr(layer, name)
            swapped = nn.RMSNorm(own.weight.shape[0], eps=own.eps)
            swapped.weight = 1.0 + own.weight
            setattr(layer, name, swapped)
    if replaced == "after the swap":
        greedy_generate(model, PROMPT, 2)  # a patched call with the swapped parts first
        monkeypatch.setattr(nn.RMSNorm, "__call__", scaled_norm_call)
    patched = greedy_generate(model, PROMPT, TOKENS)
    integration.unpatch()
    assert_traces_bit_identical(greedy_generate(model, PROMPT, TOKENS), patched)


@pytest.fixture
def counted_rms_norm(monkeypatch):
    """mx.fast.rms_norm wrapped, as a profiler would: same bits, each call counted."""
    calls = {"rms_norm": 0}
    own = mx.fast.rms_norm

    def counting(*arguments, **keywords):
        calls["rms_norm"] += 1
        return own(*arguments, **keywords)

    def install():
        monkeypatch.setattr(mx.fast, "rms_norm", counting)

    return calls, install


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3"])
def test_mx_fast_rms_norm_replaced_after_a_patched_step_sees_every_call(
        model_type, counted_rms_norm):
    calls, install = counted_rms_norm
    model = build_synthetic_model(model_type)
    integration.patch()
    greedy_generate(model, PROMPT, 2)
    install()  # no patch() since
    patched = greedy_generate(model, PROMPT, TOKENS)
    patched_calls = calls["rms_norm"]
    integration.unpatch()
    calls["rms_norm"] = 0
    reference = greedy_generate(model, PROMPT, TOKENS)
    assert_traces_bit_identical(reference, patched)
    assert patched_calls == calls["rms_norm"] > 0


def test_mx_fast_rms_norm_replaced_before_patch_sees_every_fold_call(counted_rms_norm):
    calls, install = counted_rms_norm
    model = build_synthetic_model("qwen3_next")
    install()
    reference = greedy_generate(model, PROMPT, TOKENS)
    unpatched_calls, calls["rms_norm"] = calls["rms_norm"], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        integration.patch()
    patched = greedy_generate(model, PROMPT, TOKENS)
    assert_traces_bit_identical(reference, patched)
    assert calls["rms_norm"] == unpatched_calls


# (model, attribute, the value that turns the q/k norms off): the switches
# the classes' own code reads at every call.
SWITCHES = [
    ("openelm", "normalize_qk_projections", False),
    ("bailing_moe", "use_qk_norm", False),
    ("minimax", "use_qk_norm", False),
    ("minimax_m3_vl", "use_qk_norm", False),
    ("glm4_moe", "use_qk_norm", False),  # read by the replacement itself
    ("llama4_text", "use_qk_norm", False),
    ("exaone4", "use_rope", False),
]


def attention_layers(model):
    classes = tuple(registry.families_by_class())
    return [module for _, module in model.named_modules() if isinstance(module, classes)]


@pytest.mark.parametrize("model_type, attribute, off", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_a_switch_turned_off_after_the_first_call_is_followed(model_type, attribute, off):
    model = build_synthetic_model(model_type)
    integration.patch()
    greedy_generate(model, PROMPT, 2)
    assert integration.report().engaged_layers > 0
    switched = [layer for layer in attention_layers(model) if hasattr(layer, attribute)]
    assert switched
    for layer in switched:
        setattr(layer, attribute, off)  # the patch stays on: the layers stay decided
    patched = greedy_generate(model, PROMPT, TOKENS)
    integration.unpatch()
    assert_traces_bit_identical(greedy_generate(model, PROMPT, TOKENS), patched)


@pytest.mark.parametrize("method", ["keys_and_values", "_update_in_place"])
def test_a_cache_method_changed_after_a_patched_step_runs_at_the_next_call(monkeypatch, method):
    """The class's update calls the changed method at every decode step,
    as unpatched, with no new patch()."""
    from mlx_lm.models.cache import make_prompt_cache

    cache_class = cache_module.KVCache if method == "keys_and_values" else (
        cache_module.RotatingKVCache)
    model = build_synthetic_model("qwen3")

    def caches():
        if cache_class is cache_module.KVCache:
            return make_prompt_cache(model)
        return make_prompt_cache(model, max_kv_size=64)

    def decode(caches_now, steps=TOKENS):
        return greedy_logits(model, mx.array([list(map(int, PROMPT))]), caches_now, steps)

    calls = {"method": 0}
    own = getattr(cache_class, method)

    def counting(self, *arguments, **keywords):
        calls["method"] += 1
        return own(self, *arguments, **keywords)

    integration.patch()
    patched_caches = caches()
    decode(patched_caches, 1)
    monkeypatch.setattr(cache_class, method, counting)  # no patch() since
    model(mx.array([[5]]), cache=patched_caches)
    patched_calls = calls["method"]
    integration.unpatch()
    calls["method"] = 0
    reference_caches = caches()
    monkeypatch.setattr(cache_class, method, own)
    decode(reference_caches, 1)
    monkeypatch.setattr(cache_class, method, counting)
    model(mx.array([[5]]), cache=reference_caches)
    assert patched_calls == calls["method"] > 0


# ---- The program's own classes ---------------------------------------------------------


class LoggingKVCache(cache_module.KVCache):
    """A program's cache: mlx-lm's KVCache whose update counts its calls."""

    updates = 0

    def update_and_fetch(self, keys, values):
        LoggingKVCache.updates += 1
        return super().update_and_fetch(keys, values)


class RenamedKVCache(cache_module.KVCache):
    """mlx-lm's KVCache under another name, its code unchanged."""


@pytest.mark.parametrize("when", ["before patch()", "after patch()"])
@pytest.mark.parametrize("cache_class", [LoggingKVCache, RenamedKVCache], ids=lambda c: c.__name__)
def test_a_renamed_cache_class_installed_as_kvcache_runs(monkeypatch, proofs_forgotten, when,
                                                        cache_class):
    model = build_synthetic_model("qwen3")
    own_class = cache_module.KVCache
    monkeypatch.setattr(cache_module, "KVCache", cache_class)
    LoggingKVCache.updates = 0
    reference = greedy_generate(model, PROMPT, TOKENS)
    unpatched_updates, LoggingKVCache.updates = LoggingKVCache.updates, 0
    if when == "after patch()":
        monkeypatch.setattr(cache_module, "KVCache", own_class)
        integration.patch()
        monkeypatch.setattr(cache_module, "KVCache", cache_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        integration.patch()
    patched = greedy_generate(model, PROMPT, TOKENS)
    assert_traces_bit_identical(reference, patched)
    assert LoggingKVCache.updates == unpatched_updates  # its own update at every step
    assert (unpatched_updates > 0) == (cache_class is LoggingKVCache)


# ---- References that outlive the patch -------------------------------------------------


def test_a_normalize_qk_bound_while_patched_runs_mlx_lm_s_once_unpatched():
    with integration.patch():
        from mlx_lm.models.gated_delta import normalize_qk as bound
    queries = mx.random.normal((1, 1, 4, 128), key=mx.random.key(0))
    before = dict(fold_module.call_counts)
    expected = integration.ORIGINAL_NORMALIZE_QK(queries, queries, inv_scale=0.125, eps=1e-6)
    actual = bound(queries, queries, inv_scale=0.125, eps=1e-6)
    assert fold_module.call_counts == before  # not through the package
    for a, e in zip(actual, expected):
        assert mx.array_equal(a, e).item()
    with integration.patch():
        bound(queries, queries, inv_scale=0.125, eps=1e-6)
    assert fold_module.call_counts["calls"] == before["calls"] + 1


# ---- Where unpatched raises, patched raises ---------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3", "dots1", "gemma3_text", "olmo2"])
def test_a_q_norm_without_a_weight_raises_as_unpatched(model_type):
    model = build_synthetic_model(model_type)
    layer = attention_layers(model)[0]
    layer.q_norm.weight = None
    with pytest.raises(Exception) as unpatched:
        greedy_generate(model, PROMPT, 2)
    with integration.patch():
        with pytest.raises(type(unpatched.value)):
            greedy_generate(model, PROMPT, 2)


# ---- State in one place ------------------------------------------------------------------


def test_the_integration_s_modules_import_in_no_circle():
    """Every import between the integration's modules, lazy ones (inside a
    function) included, as a graph: no circle."""
    import ast
    import pathlib

    package = pathlib.Path(integration.__file__).parent
    prefix = "mlx_dualnorm.integrations.mlx_lm"
    modules = {path.stem: path for path in package.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == prefix:
                imported |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix + "."):
                imported.add(node.module.rsplit(".", 1)[1])
        graph[name] = imported - {name}

    def circle_from(start, path):
        for imported in graph[path[-1]]:
            if imported == start:
                return path + [start]
            if imported not in path:
                found = circle_from(start, path + [imported])
                if found:
                    return found
        return None

    circles = [circle for name in graph if (circle := circle_from(name, [name]))]
    assert not circles, " -> ".join(circles[0])
    assert all(len(path.read_text().splitlines()) <= 400 for path in modules.values())


def test_the_mode_reaches_the_layer_shapes_as_an_argument():
    """Only the state, the patching and the engine read the install's mode;
    the layer shapes are passed the mode of their layer's decision."""
    import pathlib

    package = pathlib.Path(integration.__file__).parent
    readers = {
        path.name for path in package.glob("*.py")
        if "STATE.mode" in path.read_text() or ".mode = " in path.read_text()
    }
    assert readers <= {"state.py", "_patching.py", "engine.py"}


def built_modes() -> set:
    """The modes of every norm + RoPE and norm pair object the layers built."""
    from mlx_dualnorm.integrations.mlx_lm import head_norms, norm_rope

    objects = [*norm_rope._norm_ropes.values(), *head_norms._dual_norms.values()]
    return {built.mode for built in objects}


def clear_built():
    from mlx_dualnorm.integrations.mlx_lm import head_norms, norm_rope

    norm_rope.clear_norm_ropes()
    head_norms.clear_dual_norms()


def decided_modes(model) -> set:
    return {STATE.decisions[id(layer)].mode for layer in attention_layers(model)}


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2", "gemma3_text"])
def test_a_layer_runs_in_the_mode_of_the_install_it_was_decided_under(model_type):
    model = build_synthetic_model(model_type)
    reference = greedy_generate(model, PROMPT, TOKENS)
    clear_built()
    integration.patch(mode="compiled")
    compiled = greedy_generate(model, PROMPT, TOKENS)
    assert decided_modes(model) == {"compiled"}
    assert built_modes() == {"compiled"}
    engaged = integration.report().engaged_layers
    assert engaged > 0
    clear_built()
    integration.patch(mode="composed")  # no unpatch(): decided again, in the new mode
    composed = greedy_generate(model, PROMPT, TOKENS)
    assert decided_modes(model) == {"composed"}
    assert built_modes() == {"composed"}
    assert integration.report().engaged_layers == engaged  # each layer counted once
    integration.unpatch()
    clear_built()
    integration.patch(mode="compiled")
    greedy_generate(model, PROMPT, 2)
    assert decided_modes(model) == {"compiled"}
    assert built_modes() == {"compiled"}
    integration.unpatch()
    assert_traces_bit_identical(reference, compiled)
    assert_traces_bit_identical(reference, composed)
