"""Shared test helpers: every comparison is bit-exact, dtypes included."""

from __future__ import annotations

import collections
import io
import os
import pathlib
import re

import mlx.core as mx
import pytest
from hypothesis import settings

from mlx_dualnorm._bits import count_bit_differences

# ---- The default selection: long suites left out ---------------------------------
#
# Tests marked `slow` (the mx.distributed runs, the soak, the full training
# matrix, the longest property and stress runs) are left out of a run of the
# test folder, so the README's `pytest -q tests` takes minutes, not the
# quarter-hour and more that everything takes on two cores. Any `-m` on the
# command line decides instead: `-m ""` runs everything (CI does), `-m slow`
# only those. A test file named on the command line runs whole.


# Tests marked slow here: by file, "*" for every test of the file, a test
# function's name for its every parametrization, or "-text" for the tests
# whose id contains "-text". The rest of each file stays in the default run,
# and each area keeps tests there: parity, the API, errors, the C API through
# cffi, mlx-lm's models, the CLI. Chosen by `--durations`: each entry took
# seconds where most tests take a fraction of one.
SLOW_TESTS: dict[str, tuple[str, ...]] = {
    # The main job runs in the default run too, through test_readme.py.
    "test_cli_traps.py": ("test_the_main_job_checks_every_benchmarked_path_and_ends_with_its_verdict",),
    # The compiled step's cases of the training matrix; the eager ones stay.
    "test_mlx_lm_training.py": ("-compiled",),
    # The longest property runs (each example compiles kernels with g++); the
    # argument and epsilon-contract properties stay.
    "test_fuzz_arguments.py": (
        "test_compiled_path_agrees_with_the_composed_path",
        "test_any_valid_epsilon_reaches_the_compiled_kernel_exactly",
    ),
    # Python's mx.compile (the peer path) over the full matrix, and one of
    # the perturbations; the package's own matrix and the rest stay.
    "test_parity.py": (
        "test_mx_compile_path_matches_composed_over_full_matrix",
        "test_weight_applied_before_rounding_is_caught_only_where_it_differs",
    ),
    # The hypothesis properties over random shapes, dtypes and epsilons;
    # the width 0 and 1 regression tests stay.
    "test_parity_properties.py": (
        "test_compiled_dual_head_norm_equals_two_rms_norms",
        "test_one_norm_replays_over_changing_shapes",
        "test_interleaved_norms_keep_their_own_epsilon",
    ),
    # The C library installed with CMake and built against (the C API itself
    # stays, through tests/test_c_api.py); mypy over the package.
    "test_c_example.py": ("*",),
    "test_typing.py": ("*",),
    # The CLI's long runs: mlx-lm-bench, interrupted and at length.
    "test_cli_long_runs.py": ("*",),
    "test_cli_mlx_lm_traps.py": (
        "test_an_unsupported_mlx_lm_is_refused_in_one_line_with_exit_2",
        "test_prework_rows_need_normalize_qk_and_say_so_in_one_line",
        "test_mlx_lm_check_prints_a_ratio_agreeing_with_its_medians_with_range_and_rounds",
    ),
    "test_cli_new_user.py": (
        "test_the_qwen3_family_has_synthetic_models",
        "test_a_ratio_whose_rounds_span_one_is_called_noise",
        "test_gated_delta_lines_only_for_a_model_with_gated_delta_layers",
        "test_a_prompt_for_a_folder_without_a_tokenizer_is_refused_in_one_line",
        "test_a_long_prompt_shows_progress_with_the_time_left",
        "test_a_short_prompt_prints_no_progress",
        "test_mlx_lm_bench_prints_its_table_before_a_write_that_fails",
    ),
    "test_benchmark.py": ("test_chart_is_a_png",),
    # mlx-lm's other subcommands through the wrapper; generate and the
    # wrapper's own flags and errors stay.
    "test_mlx_lm_commands.py": (
        "test_the_dispatch_is_mlx_lms",
        "test_lora_trains_to_the_same_losses_and_adapter",
        "test_the_server_answers_with_mlx_lms_tokens_and_text",
        "test_an_interrupted_server_says_the_line",
        "test_benchmark_runs",
    ),
    # Decodes across a cache buffer's growth, every family; one weight-
    # following matrix of two; a whole newer-release proof; the decode
    # bench's rounds per model.
    "test_mlx_lm_cache_write.py": ("test_decode_across_a_buffer_growth_is_bit_identical",),
    "test_mlx_lm_weights.py": ("test_updated_loaded_and_trained_weights_are_followed",),
    "test_mlx_lm_proof.py": ("test_a_newer_release_runs_what_changed_as_shipped_and_patches_the_rest",),
    "test_mlx_lm_decode_bench.py": ("test_decode_rounds_alternate_the_paths_and_agree",),
}


def _listed_slow(item: pytest.Item) -> bool:
    listed = SLOW_TESTS.get(pathlib.Path(item.path).name, ())
    name = getattr(item, "originalname", None) or item.name
    return any(
        entry in ("*", name) or (entry.startswith("-") and entry in item.name) for entry in listed
    )


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    if _listed_slow(item):
        item.add_marker(pytest.mark.slow)


def _marker_expression_given(config: pytest.Config) -> bool:
    if config.option.markexpr:
        return True
    return any(
        argument.startswith("-m") and not argument.startswith("--")
        for argument in config.invocation_params.args
    )


def _files_named(config: pytest.Config) -> set[pathlib.Path]:
    named = set()
    for argument in config.args:
        path = pathlib.Path(config.invocation_params.dir, argument.split("::", 1)[0])
        if path.is_file():
            named.add(path.resolve())
    return named


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _marker_expression_given(config):
        return
    named = _files_named(config)
    kept, left_out = [], []
    for item in items:
        if item.get_closest_marker("slow") and pathlib.Path(item.path).resolve() not in named:
            left_out.append(item)
        else:
            kept.append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


def pytest_report_header(config: pytest.Config) -> str | None:
    if _marker_expression_given(config):
        return None
    return "tests marked slow are left out unless their file is named (-m \"\" runs everything)"


# ---- Hypothesis profiles ---------------------------------------------------------
#
# The property tests of test_parity_properties.py take most of a full run: on
# two CPU cores each example compiles kernels (g++) for its epsilon, dtype and
# rank, about 1 to 4 s an example. Their example counts are written for
# Hypothesis' default profile (max_examples 100) and scale with the profile
# loaded (scaled_examples), never below MINIMUM_EXAMPLES:
#
#   profile    selected by                      compiled vs composed / replays
#                                               over new shapes / interleaved eps
#   default    neither variable set             60 / 25 / 20 examples  (~240 s)
#   ci         CI set (HYPOTHESIS_PROFILE wins)  15 /  6 /  5 examples  (~60 s)
#   thorough   HYPOTHESIS_PROFILE=thorough      240 / 100 / 80 examples
#
# The ci profile keeps Hypothesis' own CI settings (derandomized, so a
# failure reproduces with HYPOTHESIS_PROFILE=ci; no example database; no
# deadline): its 15 examples still span ranks 1-4, the three dtypes, every
# weighting and special values; 6 replays chain 2-5 shapes each; 5 epsilon
# pairs alternate four calls each. The thorough profile is for exploring
# before a release.
MINIMUM_EXAMPLES = 5
settings.register_profile(
    "ci", parent=settings.get_profile("ci"), max_examples=25, deadline=None
)
settings.register_profile("thorough", max_examples=400, deadline=None)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
elif os.environ.get("CI"):
    settings.load_profile("ci")


def scaled_examples(default_profile_examples: int) -> int:
    """A test's ``max_examples`` under the loaded profile: the count it runs
    under the default profile (100 examples), scaled by the loaded
    profile's ``max_examples`` / 100."""
    scaled = round(default_profile_examples * settings.default.max_examples / 100)
    return max(MINIMUM_EXAMPLES, scaled)



def assert_bit_identical(
    actual: mx.array,
    expected: mx.array,
    context: str = "",
    nan_payloads_may_differ: bool = False,
) -> None:
    """Same dtype, same shape, same bits in every element (signed zeros and
    NaN payloads included): the package's one comparison rule, the one
    bit-exact assertion of the tests. ``context`` opens each failure
    message; ``nan_payloads_may_differ`` lets a NaN match any NaN (see
    docs/reliability.md on NaN payloads)."""
    where = (context,) if context else ()
    assert actual.dtype == expected.dtype, (*where, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (*where, actual.shape, expected.shape)
    differing = count_bit_differences(
        actual, expected, nan_payloads_may_differ=nan_payloads_may_differ
    )
    prefix = f"{context}: " if context else ""
    assert differing == 0, f"{prefix}{differing} of {actual.size} elements differ in bits"


# Unpatched repeats that decide whether mlx-lm's own step reproduces a
# gradient the patched step gave other bits to.
GRADIENT_REPEATS = 4


def assert_patched_loss_and_gradients_match(step, loss_of=lambda outputs: outputs):
    """``step()`` (a ``value_and_grad`` call: the loss, or outputs that
    ``loss_of`` reads it from, and the gradients) unpatched, then patched:
    the loss and every gradient the same bits; returns the unpatched
    gradients.

    A comparison means something only where mlx-lm's own step is
    reproducible. On MLX's CUDA backend some gradients are not (the
    embedding's scatter-add, MoE experts' gathered products): two unpatched
    steps may differ, or agree by chance and differ on the third. So a
    gradient the patched step gave other bits is left out only where one of
    up to :data:`GRADIENT_REPEATS` more unpatched steps differs from the
    first too; every other gradient is compared, and the test skips where
    one the package's call computes or feeds (a norm's, a query or key
    projection's) is left out."""
    from mlx.utils import tree_flatten

    from mlx_dualnorm.integrations import mlx_lm as integration

    outputs, gradients = step()
    with integration.patch():
        patched_outputs, patched_gradients = step()
    assert_bit_identical(loss_of(patched_outputs), loss_of(outputs))
    flat_gradients = dict(tree_flatten(gradients))
    flat_patched_gradients = dict(tree_flatten(patched_gradients))
    assert flat_patched_gradients.keys() == flat_gradients.keys()
    differing = {
        path for path, gradient in flat_patched_gradients.items()
        if count_bit_differences(gradient, flat_gradients[path])
    }
    unreproducible: set = set()
    for _ in range(GRADIENT_REPEATS if differing else 0):
        repeated = dict(tree_flatten(step()[1]))
        unreproducible |= {
            path for path in differing
            if count_bit_differences(repeated[path], flat_gradients[path])
        }
        if unreproducible == differing:
            break
    if any(carries_the_prework_cotangent(path) for path in unreproducible):
        pytest.skip("unpatched steps give this model's q/k norm or projection gradients "
                    "other bits here")
    for path, gradient in flat_patched_gradients.items():
        if path not in unreproducible:
            assert_bit_identical(gradient, flat_gradients[path], path)
    return gradients


# The projections whose weight gradients are made from the cotangents the
# package's call gives its queries and keys.
_QUERY_KEY_PROJECTIONS = ("q_proj", "k_proj", "qkv_proj")


def carries_the_prework_cotangent(path: str) -> bool:
    """Whether a flattened parameter path names a weight whose gradient the
    package's call computes or feeds: a norm module's, or a query or key
    projection's."""
    parts = path.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and (
        "norm" in parts[-2] or parts[-2] in _QUERY_KEY_PROJECTIONS
    )


def assert_transforms_agree(transform: str, actual, expected, primals, vmap_arguments) -> None:
    """``actual`` and ``expected``, functions of (queries, keys,
    query_weight, key_weight) returning a list of arrays, give the same bits
    under ``transform``: "vjp" and "jvp" at ``primals`` with the same seeded
    cotangents or tangents, or "vmap" over ``vmap_arguments`` (queries and
    keys batched on axis 0, the weights shared)."""

    def transformed(function):
        if transform == "vjp":
            cotangents = [
                mx.random.normal(output.shape, key=mx.random.key(20 + index))
                for index, output in enumerate(expected(*primals))
            ]
            return mx.vjp(function, primals, cotangents)[1]
        if transform == "jvp":
            tangents = [
                mx.random.normal(primal.shape, key=mx.random.key(30 + index))
                for index, primal in enumerate(primals)
            ]
            return mx.jvp(function, primals, tangents)[1]
        return mx.vmap(function, in_axes=(0, 0, None, None))(*vmap_arguments)

    expected_outputs = transformed(expected)
    actual_outputs = transformed(actual)
    assert len(actual_outputs) == len(expected_outputs)
    for a, e in zip(actual_outputs, expected_outputs):
        assert_bit_identical(a, e)


@pytest.fixture
def unpatched_mlx_lm():
    """mlx-lm as it ships before and after the test: the package's patch
    removed either side (modules of mlx-lm tests use it for every test)."""
    from mlx_dualnorm.integrations import mlx_lm as integration

    integration.unpatch()
    yield
    integration.unpatch()


# ---- Counting calls of classes whose code the patch must prove -------------------
#
# The patch engages a layer only where its norms' and RoPE's __call__ are the
# recorded code, so a test that wraps those to count calls must also record
# the wrapper, or every layer is (rightly) left to mlx-lm. The wrapper is a
# module function here (a nested one has no fingerprint) that counts per
# module and calls the class's own __call__.
_COUNTED_CALLS: collections.Counter = collections.Counter()
_UNCOUNTED_CALLS: dict = {}


def counted_call(self, *arguments, **keywords):
    _COUNTED_CALLS[id(self)] += 1
    own_call = next(_UNCOUNTED_CALLS[cls] for cls in type(self).__mro__ if cls in _UNCOUNTED_CALLS)
    return own_call(self, *arguments, **keywords)


def forget_proofs() -> None:
    """Drops the integration's cached proofs (a test changed recorded code
    or a piece): each piece is fingerprinted again at its next use."""
    from mlx_dualnorm.integrations.mlx_lm import cache_update, engine, registry

    registry.forget_verdicts()
    cache_update.forget_cache_proofs()
    engine._part_class_set = None


def count_module_calls(monkeypatch, classes) -> collections.Counter:
    """Counts, per module (by id), calls of each class's own ``__call__``
    for the rest of the test, with the counting wrapper recorded as proven
    code of each class (what the patch's own path does not call stays 0)."""
    from mlx_dualnorm.integrations.mlx_lm import registry
    from mlx_dualnorm.integrations.mlx_lm.fingerprints import function_fingerprint

    fingerprint = function_fingerprint(counted_call)
    assert fingerprint is not None
    _COUNTED_CALLS.clear()
    for counted_class in classes:
        if vars(counted_class).get("__call__") is counted_call:
            continue
        _UNCOUNTED_CALLS[counted_class] = counted_class.__call__
        monkeypatch.setattr(counted_class, "__call__", counted_call)
        piece = registry.piece_name(counted_class, "__call__")
        monkeypatch.setitem(
            registry.RECORDED_CODE, piece, registry.RECORDED_CODE.get(piece, frozenset()) | {fingerprint}
        )
    forget_proofs()
    return _COUNTED_CALLS


def count_applied_calls(monkeypatch, module, name: str, counts: dict, key: str) -> None:
    """Replaces ``module.name`` for the test with a wrapper that adds 1 to
    ``counts[key]`` each time the function returns something other than
    None (how the integration's entry points say they applied)."""
    function = getattr(module, name)

    def counting(*arguments):
        result = function(*arguments)
        counts[key] += result is not None
        return result

    monkeypatch.setattr(module, name, counting)


def graph_primitives(*outputs: mx.array) -> list[str]:
    """The primitive names of the graph behind `outputs`, sorted."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return sorted(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))


@pytest.fixture
def rng_key() -> mx.array:
    return mx.random.key(20261129)


@pytest.fixture
def mlx_c_messages():
    """The messages mlx-c hands its error handler during the test, in order,
    caught by a handler of the test's own; the package's handler is put back
    afterwards. For tests of raw mlx-c calls, whose messages the package's
    handler keeps only for its own calls."""
    from mlx_dualnorm._native import ffi, lib

    messages: list[str] = []

    def keep(message, data) -> None:
        messages.append(ffi.string(message).decode(errors="replace"))

    handler = ffi.callback("mlx_error_handler_func", keep)
    lib.mlx_set_error_handler(handler, ffi.NULL, ffi.NULL)
    try:
        yield messages
    finally:
        lib.mlx_dualnorm_install_error_handler()
