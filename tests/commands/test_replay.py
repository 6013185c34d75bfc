"""The greedy-decode replay: the real paths decode exactly as the composed
path does, and the replay notices a path that is off, even by one ulp in
one element."""

from __future__ import annotations

import mlx.core as mx
import pytest

from helpers.bit_parity import assert_bit_identical
from mlx_dualnorm import available_modes
from mlx_dualnorm.commands import replay
from mlx_dualnorm.commands.shared import paths
from mlx_dualnorm.commands.shared.paths import DualNormPath, make_composed_path
from mlx_dualnorm.commands.replay import (
    GreedyDecodeTrace,
    ReplayModelConfig,
    build_replay_model,
    compare_decode_traces,
    greedy_decode,
    run_replay,
)


def make_path_nudging_one_key_element_by_one_ulp(eps: float) -> DualNormPath:
    """The composed path, except the first element of the normalized keys
    is one ulp larger (its bit pattern plus one): the smallest possible
    error a kernel could make."""
    composed_path = make_composed_path(eps)

    def nudging(queries, keys, query_weight, key_weight):
        normalized_queries, normalized_keys = composed_path(queries, keys, query_weight, key_weight)
        unsigned_dtype = {2: mx.uint16, 4: mx.uint32}[normalized_keys.dtype.size]
        first_element = (mx.arange(normalized_keys.size) == 0).reshape(normalized_keys.shape)
        key_bits = mx.view(normalized_keys, unsigned_dtype)
        nudged_bits = key_bits + first_element.astype(unsigned_dtype)
        return normalized_queries, mx.view(nudged_bits, normalized_keys.dtype)

    return nudging


def make_path_ignoring_norm_weights(eps: float) -> DualNormPath:
    """Drops the q/k norm weights: a fused kernel that forgot them."""
    composed_path = make_composed_path(eps)

    def ignoring(queries, keys, query_weight, key_weight):
        return composed_path(queries, keys, None, None)

    return ignoring


def test_every_registered_path_decodes_exactly_like_the_composed_path() -> None:
    report = run_replay()

    assert report.steps == replay.DEFAULT_DECODE_STEPS == 128
    assert sorted(comparison.path_name for comparison in report.comparisons) == sorted(
        ["compiled", "mx_compile", *(["fused"] if "fused" in available_modes() else [])]
    )
    for comparison in report.comparisons:
        assert comparison.tokens_identical
        assert comparison.final_hidden_state_identical
        assert comparison.first_divergence_step is None
        assert not comparison.diverged
    assert report.passed, replay.format_replay_report(report)
    # A decode stuck on one token would make "tokens identical" cheap.
    assert len(set(report.reference.token_ids)) >= 16


def test_one_ulp_in_one_normalized_key_is_detected() -> None:
    report = run_replay({"one-ulp": make_path_nudging_one_key_element_by_one_ulp}, steps=32)

    (comparison,) = report.comparisons
    assert comparison.diverged
    assert comparison.first_divergent_hidden_step is not None
    assert not comparison.final_hidden_state_identical
    assert not report.passed


def test_ignored_norm_weights_change_the_generated_tokens() -> None:
    report = run_replay({"weights-ignored": make_path_ignoring_norm_weights}, steps=32)

    (comparison,) = report.comparisons
    assert not comparison.tokens_identical
    assert comparison.first_divergent_token_step is not None
    assert comparison.first_divergence_step == comparison.first_divergent_hidden_step == 0


def test_decoding_is_deterministic() -> None:
    """Two composed decodes agree bit for bit, so a divergence is the path's."""
    config = ReplayModelConfig()
    parameters = build_replay_model(config)
    first = greedy_decode(make_composed_path(config.rms_norm_eps), parameters, config, steps=24)
    second = greedy_decode(make_composed_path(config.rms_norm_eps), parameters, config, steps=24)

    assert first.token_ids == second.token_ids
    assert_bit_identical(first.step_hidden_states, second.step_hidden_states)
    assert first.step_hidden_states.shape == (24, config.model_width)
    assert first.step_hidden_states.dtype == mx.bfloat16


def test_float32_model_replays_identically() -> None:
    report = run_replay(
        {"compiled": replay.PATH_FACTORIES["compiled"]},
        config=ReplayModelConfig(dtype=mx.float32),
        steps=24,
    )

    assert report.passed, replay.format_replay_report(report)


def test_comparison_names_the_first_divergent_steps() -> None:
    hidden_states = mx.zeros((5, 4), dtype=mx.bfloat16)
    reference = GreedyDecodeTrace("composed", (1, 2, 3, 4, 5), hidden_states, 0.0)
    # -0.0 equals 0.0 as a value but not as bits: the comparison is bitwise.
    shifted_hidden_states = mx.where(
        (mx.arange(5)[:, None] == 2) & (mx.arange(4)[None, :] == 1),
        mx.array(-0.0, dtype=mx.bfloat16),
        hidden_states,
    )
    trace = GreedyDecodeTrace("path", (1, 2, 3, 9, 5), shifted_hidden_states, 0.0)

    comparison = compare_decode_traces(trace, reference)

    assert not comparison.tokens_identical
    assert comparison.first_divergent_token_step == 3
    assert comparison.first_divergent_hidden_step == 2
    assert comparison.final_hidden_state_identical
    assert comparison.first_divergence_step == 2


def test_main_prints_a_summary_and_returns_zero_when_paths_agree(capsys) -> None:
    exit_status = replay.main(["--steps", "16", "--path", "compiled"])

    printed = capsys.readouterr().out
    assert exit_status == 0
    assert "compiled" in printed and "bit-identical" in printed and "PASS" in printed


def test_main_returns_nonzero_on_divergence(capsys) -> None:
    exit_status = replay.main(
        ["--steps", "8"], path_factories={"one-ulp": make_path_nudging_one_key_element_by_one_ulp}
    )

    printed = capsys.readouterr().out
    assert exit_status == 1
    assert "DIVERGED" in printed and "FAIL" in printed


def test_main_rejects_a_nonpositive_step_count(capsys) -> None:
    assert replay.main(["--steps", "0"]) == 2
    assert "argument --steps: must be at least 1, got 0" in capsys.readouterr().err


def test_the_rope_paths_decode_exactly_like_the_composed_prework() -> None:
    """The full-attention layer's norms + RoPE in one call, and its RoPE alone
    in one call of the object without norms, over a prompt and 48 growing
    offsets: the composed decode's tokens and every hidden state's bits."""
    runnable = [name for name in replay.ROPE_PATHS if not replay.rope_path_reasons([name])]
    report = run_replay({}, steps=48, rope_paths=runnable)

    assert {"rope_compiled", "rope_only_compiled"} <= set(runnable)
    assert [comparison.path_name for comparison in report.comparisons] == runnable
    assert report.passed, replay.format_replay_report(report)
    assert len(set(report.reference.token_ids)) >= 16


def test_a_rope_of_another_base_in_the_attention_prework_is_detected() -> None:
    """The replay sees a prework path rotating by another base: the check of
    the rope paths can fail."""
    config = ReplayModelConfig()
    parameters = build_replay_model(config)
    composed = make_composed_path(config.rms_norm_eps)
    reference = greedy_decode(composed, parameters, config, steps=16)

    def other_base(queries: mx.array, keys: mx.array, query_weight: mx.array,
                   key_weight: mx.array, offset: int) -> tuple[mx.array, ...]:
        queries, keys = composed(queries, keys, query_weight, key_weight)
        return tuple(
            mx.fast.rope(heads.transpose(0, 2, 1, 3), config.attention_rotary_width,
                         traditional=False, base=10001.0, scale=1.0, offset=offset)
            for heads in (queries, keys)
        )

    trace = greedy_decode(composed, parameters, config, steps=16, norm_rope=other_base)
    assert compare_decode_traces(trace, reference).diverged


def test_main_runs_the_rope_paths_by_default_and_refuses_one_that_cannot_run(
    capsys, monkeypatch
) -> None:
    assert replay.main(["--steps", "8"]) == 0
    printed = capsys.readouterr().out
    assert "rope_compiled" in printed and "rope_only_compiled" in printed
    assert "norms, transposes and RoPE in one call" in printed
    # A build without the fused mode, on any machine.
    monkeypatch.setattr(paths, "available_modes", lambda: ("composed", "compiled"))
    assert replay.main(["--steps", "8", "--path", "rope_fused"]) == 2
    assert "[replay] path 'rope_fused': mode 'fused' is not available here" in (
        capsys.readouterr().err
    )


def test_an_unknown_rope_path_is_refused_naming_the_command() -> None:
    with pytest.raises(ValueError, match=r"^\[replay\] unknown rope paths \['rope_typo'\]"):
        run_replay({}, steps=1, rope_paths=["rope_typo"])
