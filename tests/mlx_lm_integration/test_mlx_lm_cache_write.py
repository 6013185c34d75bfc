"""The mlx-lm patch with the KV-cache write in the package's call: for
mlx-lm's ``KVCache``, ``BatchKVCache``, ``RotatingKVCache`` and
``BatchRotatingKVCache``, the tokens, the logits of every step and every
element of the cache buffers are bit-identical patched and unpatched,
across a step that grows the buffer, a trimmed cache, a prompt cache saved
and loaded back, batched generation of prompts of different lengths and
rotating caches that wrap around, alone and batched; the decode steps
within a buffer go through the one-call path."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

from helpers.bit_parity import assert_bit_identical  # noqa: E402
from helpers.mlx_lm_patch import count_applied_calls, forget_proofs  # noqa: E402
from mlx_lm.models import cache as cache_module  # noqa: E402
from test_mlx_lm_full_attention import build_model  # noqa: E402

from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import cache_update, registry  # noqa: E402
from helpers.mlx_lm_families import build_synthetic_model  # noqa: E402

PROMPT_LENGTH = 250
DECODE_STEPS = 12  # the step writing row 256 grows the buffer


@pytest.fixture
def one_call_writes(monkeypatch):
    """Counts the layer calls whose cache write went through the package's
    one call."""
    counts = {"one_call": 0}
    count_applied_calls(monkeypatch, cache_update, "_written_in_one_call", counts, "one_call")
    return counts


class BatchTokenizer:
    """What batch_generate reads of a tokenizer: no end-of-sequence token,
    so every sequence runs to max_tokens."""

    eos_token_ids: set = set()

    def decode(self, tokens):
        return " ".join(map(str, tokens))


def prompt_tokens(length, start=11):
    return mx.array([(37 * position + start) % 512 for position in range(length)])


def greedy_decode(model, prompt, steps, cache):
    """Prefill, then ``steps`` greedy tokens one at a time: the logits of
    every step (prefill included), the tokens and the cache."""
    logits_per_step, tokens = [], []
    logits = model(prompt[None], cache=cache)[:, -1, :]
    for _ in range(steps):
        logits_per_step.append(logits)
        token = mx.argmax(logits, axis=-1)
        mx.eval(token, logits)
        tokens.append(token.item())
        logits = model(token[:, None], cache=cache)[:, -1, :]
    logits_per_step.append(logits)
    mx.eval(logits_per_step)
    return tokens, logits_per_step


def assert_states_identical(actual, expected):
    """Arrays bit for bit, sequences element by element, the rest equal."""
    if isinstance(expected, mx.array):
        assert_bit_identical(actual, expected)
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for actual_part, expected_part in zip(actual, expected):
            assert_states_identical(actual_part, expected_part)
    else:
        assert actual == expected


def assert_caches_identical(actual, expected):
    assert len(actual) == len(expected)
    for actual_layer, expected_layer in zip(actual, expected):
        assert type(actual_layer) is type(expected_layer)
        assert_states_identical(actual_layer.state, expected_layer.state)


def run_both(model, run):
    """``run()`` unpatched, then patched: both results."""
    reference = run()
    with integration.patch():
        patched = run()
    return reference, patched


def assert_runs_identical(reference, patched):
    (reference_tokens, reference_logits, reference_cache) = reference
    (patched_tokens, patched_logits, patched_cache) = patched
    assert patched_tokens == reference_tokens
    assert len(patched_logits) == len(reference_logits)
    for actual, expected in zip(patched_logits, reference_logits):
        assert_bit_identical(actual, expected)
    assert_caches_identical(patched_cache, reference_cache)


def runs_identical(reference, patched) -> bool:
    try:
        assert_runs_identical(reference, patched)
    except AssertionError:
        return False
    return True


# Unpatched runs tried before a patched run that differs from the first is
# called different from every outcome of mlx-lm's own.
UNPATCHED_ATTEMPTS = 4


# Families whose attention writes the cache in the norm + RoPE call: the
# qwen3 shapes, the qwen3-like shape with partial rotary (glm4_moe), the
# shapes that normalize after the transpose, with the weight of each norm
# class (gemma3_text's 1 + w, plamo3's w + offset, bailing_moe's and
# openelm's w), a whole-projection norm (olmo2), and the per-head shapes
# whose values pass a v_norm first (gemma3n, gemma4_text, with KV-shared
# layers that read another layer's cache).
CACHE_WRITING_FAMILIES = (
    "qwen3", "qwen3_next", "glm4_moe", "gemma3_text", "plamo3", "bailing_moe", "openelm", "olmo2",
    "gemma3n", "gemma4_text",
)


def build_cache_model(model_type):
    if model_type == "qwen3":
        return build_model(model_type)
    return build_synthetic_model(model_type)


@pytest.mark.parametrize("model_type", CACHE_WRITING_FAMILIES)
def test_decode_across_a_buffer_growth_is_bit_identical(model_type, one_call_writes):
    """On CPU one outcome, which the patched run must give. MLX's CUDA
    backend gives one of two outcomes from run to run across a buffer
    growth, unpatched as patched (docs/results/2026-12-01-h200-families.md):
    there the patched run must give one that unpatched runs give."""
    model = build_cache_model(model_type)

    def run():
        cache = cache_module.make_prompt_cache(model)
        tokens, logits = greedy_decode(model, prompt_tokens(PROMPT_LENGTH), DECODE_STEPS, cache)
        return tokens, logits, cache

    reference, patched = run_both(model, run)
    if mx.default_device() == mx.gpu:
        for _ in range(UNPATCHED_ATTEMPTS - 1):
            if runs_identical(reference, patched):
                break
            reference = run()
    assert_runs_identical(reference, patched)
    written_classes = (cache_module.KVCache, cache_module.RotatingKVCache)
    layers = sum(type(layer) in written_classes for layer in patched[2])
    assert layers > 0
    # Prefill and the step that grows a KVCache (or first trims a sliding
    # window's RotatingKVCache to its size) take the class's own update:
    # every other decode step is one call per layer.
    assert one_call_writes["one_call"] == layers * (DECODE_STEPS - 1)
    assert all(layer.keys.shape[2] == 512 for layer in patched[2]
               if type(layer) is cache_module.KVCache)


def test_a_trimmed_cache_and_decode_after_it_are_bit_identical(one_call_writes):
    """Trimming leaves offset % step != 0 inside the buffer: later writes
    overwrite the trimmed rows, and a growth afterwards trims the buffer to
    the offset before concatenating, as the class does."""
    model = build_model("qwen3")

    def run():
        cache = cache_module.make_prompt_cache(model)
        greedy_decode(model, prompt_tokens(240), 8, cache)
        assert cache_module.can_trim_prompt_cache(cache)
        cache_module.trim_prompt_cache(cache, 5)
        tokens, logits = greedy_decode(model, prompt_tokens(20, start=3), 6, cache)
        return tokens, logits, cache

    reference, patched = run_both(model, run)
    assert_runs_identical(reference, patched)
    assert one_call_writes["one_call"] > 0


def test_a_saved_and_loaded_prompt_cache_decodes_identically(tmp_path, one_call_writes):
    model = build_model("qwen3")

    def run(name):
        cache = cache_module.make_prompt_cache(model)
        greedy_decode(model, prompt_tokens(30), 4, cache)
        path = str(tmp_path / f"{name}.safetensors")
        cache_module.save_prompt_cache(path, cache, {"name": name})
        loaded, metadata = cache_module.load_prompt_cache(path, return_metadata=True)
        assert metadata == {"name": name}
        tokens, logits = greedy_decode(model, prompt_tokens(1, start=7), 5, loaded)
        return tokens, logits, loaded

    reference = run("reference")
    with integration.patch():
        patched = run("patched")
    assert_runs_identical(reference, patched)
    assert one_call_writes["one_call"] > 0


@pytest.mark.parametrize("prompt_length", [10, 40], ids=["short-prompt", "prompt-over-max"])
def test_a_rotating_cache_wrapping_around_is_bit_identical(prompt_length, one_call_writes):
    """``make_prompt_cache(model, max_kv_size=24)``, as ``generate`` builds it
    for ``max_kv_size``: RotatingKVCache layers that keep 4 rows and
    overwrite the rest in a ring. 40 steps wrap the ring more than once;
    a prompt longer than the ring makes the first step trim it. The
    buffers, offsets and write indices match mlx-lm's after every run."""
    model = build_model("qwen3")
    steps = 40

    def run():
        cache = cache_module.make_prompt_cache(model, max_kv_size=24)
        tokens, logits = greedy_decode(model, prompt_tokens(prompt_length), steps, cache)
        return tokens, logits, cache

    reference, patched = run_both(model, run)
    assert_runs_identical(reference, patched)
    assert all(type(layer) is cache_module.RotatingKVCache for layer in patched[2])
    assert all(layer.offset == prompt_length + steps for layer in patched[2])
    # Class updates: growing the short prompt's buffer to the ring's size
    # (one step), trimming the long prompt's to it (one step).
    assert one_call_writes["one_call"] == len(model.layers) * (steps - 1)


def test_a_cache_class_of_unrecorded_code_keeps_its_own_update(monkeypatch, one_call_writes):
    """The call performs a cache class's update itself only where the
    class's code is the recorded one: with RotatingKVCache's record taken
    out (as on a release whose class differs), every step runs the class's
    own update_and_fetch, with the same bits."""
    monkeypatch.delitem(
        registry.RECORDED_CODE, "mlx_lm.models.cache.RotatingKVCache._update_in_place"
    )
    forget_proofs()
    model = build_model("qwen3")

    def run():
        cache = cache_module.make_prompt_cache(model, max_kv_size=24)
        tokens, logits = greedy_decode(model, prompt_tokens(10), 20, cache)
        return tokens, logits, cache

    try:
        reference, patched = run_both(model, run)
    finally:
        monkeypatch.undo()
        forget_proofs()
    assert_runs_identical(reference, patched)
    assert one_call_writes["one_call"] == 0


def test_to_quantized_after_patched_decode_is_identical():
    model = build_model("qwen3")

    def run():
        cache = cache_module.make_prompt_cache(model)
        greedy_decode(model, prompt_tokens(20), 4, cache)
        return [layer.to_quantized(group_size=64, bits=8) for layer in cache]

    reference, patched = run_both(model, run)
    for actual, expected in zip(patched, reference):
        assert actual.offset == expected.offset
        for actual_part, expected_part in zip(actual.keys + actual.values,
                                              expected.keys + expected.values):
            assert_bit_identical(actual_part, expected_part)


def assert_batch_generate_identical(model, prompt_shapes, max_tokens):
    """mlx-lm's batch_generate over prompts of the given (length, start)
    shapes, unpatched then patched: the token ids, the log-probabilities
    and every returned prompt cache the same bits."""
    from mlx_lm.generate import batch_generate

    prompts = [[int(t) for t in prompt_tokens(length, start)] for length, start in prompt_shapes]

    def run():
        return batch_generate(model, BatchTokenizer(), prompts, max_tokens=max_tokens,
                              return_prompt_caches=True, return_token_ids=True,
                              return_logprobs=True)

    reference, patched = run_both(model, run)
    assert patched.token_ids == reference.token_ids
    assert patched.logprobs == reference.logprobs
    for actual_caches, expected_caches in zip(patched.caches, reference.caches):
        assert_caches_identical(actual_caches, expected_caches)


def test_batch_generate_with_prompts_of_different_lengths_is_bit_identical(one_call_writes):
    """mlx-lm's batch_generate: left-padded prompts in a BatchKVCache, whose
    RoPE offsets are per row and whose write row is shared."""
    assert_batch_generate_identical(build_model("qwen3"), ((5, 1), (17, 2), (250, 3)), 10)
    assert one_call_writes["one_call"] > 0


@pytest.fixture
def written_cache_kinds(monkeypatch):
    """The cache kinds whose steps the one call wrote, with their counts."""
    counts: dict = {}
    cache_step = cache_update._cache_step

    def counting(kind, cache, length):
        step = cache_step(kind, cache, length)
        if step is not None:
            counts[kind] = counts.get(kind, 0) + 1
        return step

    monkeypatch.setattr(cache_update, "_cache_step", counting)
    return counts


def test_batch_generate_over_sliding_windows_is_bit_identical(written_cache_kinds):
    """gemma3_text's sliding-window layers under batch_generate: a
    BatchRotatingKVCache of 8 rows per window, prompts of different lengths
    (left padding), 24 tokens each, so that the ring wraps around: tokens,
    log-probabilities and every cache the same bits, its steps written in
    the package's call."""
    assert_batch_generate_identical(
        build_synthetic_model("gemma3_text"), ((3, 1), (6, 2), (11, 3)), 24
    )
    assert written_cache_kinds.get("batched rotating", 0) > 0
    assert written_cache_kinds.get("batched", 0) > 0


def test_batch_kv_cache_direct_steps_are_bit_identical(one_call_writes):
    """BatchKVCache driven directly: left padding, a prefill, decode steps
    and a trim, buffers and per-row offsets compared after each phase."""
    model = build_model("qwen3")
    left_padding = [3, 0, 7]
    tokens = mx.stack([prompt_tokens(12, start) for start in (1, 2, 3)])

    def run():
        cache = [cache_module.BatchKVCache(left_padding) for _ in model.layers]
        logits = [model(tokens, cache=cache)[:, -1, :]]
        for step in range(6):
            token = mx.argmax(logits[-1], axis=-1)
            logits.append(model(token[:, None], cache=cache)[:, -1, :])
            if step == 3:
                for layer in cache:
                    layer.trim(2)
        mx.eval(logits)
        return [], logits, cache

    reference, patched = run_both(model, run)
    assert_runs_identical(reference, patched)
    assert one_call_writes["one_call"] == len(model.layers) * 6
