"""The suite's selection (tests marked slow), Hypothesis' profiles and the
fixtures of more than one folder. Helpers live in tests/helpers/."""

from __future__ import annotations

import pathlib

import pytest

# pytest's default ("prepend") import mode puts this file's folder on
# sys.path as it loads it, so the test modules of every group folder
# (core, facade, errors, mlx_lm_integration, commands, c) import
# ``helpers.<module>``. Each test module is imported by its basename, so
# basenames stay unique across the folders (SLOW_TESTS below names files by
# basename too). No folder here may take an installed package's name: this
# folder is on sys.path, so a folder called mlx_lm would import as mlx_lm
# where mlx-lm is not installed.
from helpers import hypothesis_profiles  # noqa: F401  (registers and loads the profile)

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
    # stays, through tests/c/test_c_api.py); mypy over the package.
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
