"""mlx-lm-bench's decode measurement at released models' dimensions, at
tiny sizes: the rounds pair both paths in alternating order, the greedy
tokens of every round are compared, and a patch that changes them makes the
command exit 1. Nothing here asserts a speed."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import qwen3  # noqa: E402
from mlx_dualnorm.commands import mlx_lm_bench  # noqa: E402
from mlx_dualnorm.commands.shared.synthetic import (  # noqa: E402
    DECODE_MODELS,
    decode_model_config,
)

TINY_LAYER_SHAPES = {"hidden_size": 64, "intermediate_size": 128}


def tiny_config(model: str) -> dict:
    """The model's config with its quick layer count, a small vocabulary
    and a narrow hidden size; the attention and gated-delta head shapes stay."""
    config = decode_model_config(model, layers=DECODE_MODELS[model].quick_layers, vocab_size=256)
    return {**config, **TINY_LAYER_SHAPES}


@pytest.fixture
def patch_states_per_run(monkeypatch):
    """Whether the patch was installed during each decode run, in order."""
    states = []
    timed_decode = mlx_lm_bench.measurements.timed_greedy_decode

    def recording(model, prompt, steps, *progress_arguments):
        states.append(integration.is_patched())
        return timed_decode(model, prompt, steps, *progress_arguments)

    monkeypatch.setattr(mlx_lm_bench.measurements, "timed_greedy_decode", recording)
    return states


def corrupt_full_attention_prework(monkeypatch):
    """Patched full-attention layers attend with zeroed queries: a patch
    that computes the wrong prework."""
    prework_and_cache_update = qwen3._prework_and_cache_update

    def zeroed_queries(attention, queries, keys, values, cache):
        attended = prework_and_cache_update(attention, queries, keys, values, cache)
        if attended is None:
            return None
        rotated_queries, cached_keys, cached_values = attended
        return mx.zeros_like(rotated_queries), cached_keys, cached_values

    monkeypatch.setattr(qwen3, "_prework_and_cache_update", zeroed_queries)


@pytest.mark.parametrize("model", list(DECODE_MODELS))
def test_decode_rounds_alternate_the_paths_and_agree(model, patch_states_per_run):
    measurement = mlx_lm_bench.run_decode(model, steps=3, rounds=3, config=tiny_config(model))
    # warm-up unpatched then patched; rounds alternate which path goes first
    assert patch_states_per_run == [False, True, False, True, True, False, False, True]
    timing = measurement.timing
    assert len(timing.unpatched) == len(timing.patched) == len(timing.time_ratios) == 3
    assert all(ratio > 0 for ratio in timing.time_ratios)
    assert measurement.token_mismatch is None
    summary = measurement.summary()
    assert summary["greedy_tokens_identical"] and summary["quick_reduced"]
    assert summary["weights_dtype"] == "bfloat16" and summary["decode_steps_per_round"] == 3
    assert summary["dimensions"]["num_hidden_layers"] == DECODE_MODELS[model].quick_layers
    engaged = summary["patch_engaged"]
    assert set(engaged) == {
        "attention_layers_engaged", "attention_layers_left", "by_prework",
        "gated_delta_calls_folded",
    }
    if model.startswith("qwen3"):  # the families covered since the first release
        layers = DECODE_MODELS[model].quick_layers
        attention = layers // 4 if model.startswith("qwen3_next") else layers
        assert engaged["attention_layers_engaged"] == attention
        assert engaged["by_prework"] == {"norm + RoPE": attention}
        assert engaged["attention_layers_left"] == 0
        assert (engaged["gated_delta_calls_folded"] > 0) == model.startswith("qwen3_next")


def test_qwen3_next_dimensions_count_both_kinds_of_layer():
    measurement_config = decode_model_config("qwen3_next-2048")
    dimensions = mlx_lm_bench.DecodeMeasurement(
        "qwen3_next-2048", "", measurement_config, False, 16, 1,
        mlx_lm_bench.PairedTiming("", "ms/token", [1.0], [1.0]), None,
    ).dimensions()
    assert dimensions["num_hidden_layers"] == 24
    assert (dimensions["gated_delta_layers"], dimensions["full_attention_layers"]) == (18, 6)
    assert dimensions["head_dim"] == 256 and dimensions["vocab_size"] == 151936


def test_decode_finds_tokens_a_wrong_patch_changes(monkeypatch):
    corrupt_full_attention_prework(monkeypatch)
    measurement = mlx_lm_bench.run_decode(
        "qwen3-1024", steps=4, rounds=2, config=tiny_config("qwen3-1024")
    )
    assert measurement.token_mismatch is not None
    assert measurement.token_mismatch.startswith("round 0, patched: step ")
    assert measurement.summary()["greedy_tokens_identical"] is False


def test_first_token_mismatch():
    assert mlx_lm_bench.first_token_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert mlx_lm_bench.first_token_mismatch([1, 2, 3], [1, 5, 3]) == "step 1: token 5, expected 2"
    assert mlx_lm_bench.first_token_mismatch([1, 2, 3], [1, 2]) == "2 tokens, expected 3"


def test_bench_exits_1_on_a_token_mismatch(monkeypatch, tmp_path, capsys):
    corrupt_full_attention_prework(monkeypatch)
    report_path = tmp_path / "report.json"
    arguments = [
        "--quick", "--decode-models", "qwen3-1024", "--decode-steps", "4",
        "--json", str(report_path),
    ]
    assert mlx_lm_bench.main(arguments) == 1
    captured = capsys.readouterr()
    assert "TOKEN MISMATCH: qwen3-1024" in captured.err
    assert "QUICK: reduced from 28 layers" in captured.out and "lower is better" in captured.out
    (decode,) = json.loads(report_path.read_text())["decode"]
    assert decode["model"] == "qwen3-1024" and decode["greedy_tokens_identical"] is False
    assert decode["dimensions"]["vocab_size"] == mlx_lm_bench.QUICK_DECODE_VOCABULARY
    assert decode["patch_engaged"]["attention_layers_engaged"] == 2
    assert "  patch engaged: attention layers 2 (norm + RoPE 2), left to mlx-lm 0; " \
        "gated-delta calls folded 0 (warm-up run)\n" in captured.out


def test_a_model_the_patch_covers_nothing_of_is_flagged():
    """The table says when the patch engaged nothing: that row's ratio is
    noise, whatever it shows."""
    timing = mlx_lm_bench.PairedTiming("decode", "ms/token", [1.0], [1.0])
    nothing = {
        "attention_layers_engaged": 0, "attention_layers_left": 0, "by_prework": {},
        "gated_delta_calls_folded": 0,
    }
    measurement = mlx_lm_bench.DecodeMeasurement(
        "olmo2-2048", "OLMo 2 1B", decode_model_config("olmo2-2048"), False, 16, 1, timing, None,
        nothing,
    )
    table = mlx_lm_bench.format_decode_table([measurement], "cpu")
    assert "NOTHING: the patch covers no layer of this model, the ratio is noise" in table


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--decode-models", "qwen3-4096"], "--decode-models: unknown"),
        (["--decode-models", "qwen3-1024", "--decode-steps", "0"], "at least 1"),
        (["--decode-models", ""], "--decode-models: no model named"),
        (["--decode-models", "qwen3-1024,,llama-2048"], "--decode-models: an empty name"),
    ],
)
def test_bench_refuses_bad_decode_arguments(arguments, message, capsys):
    assert mlx_lm_bench.main(arguments) == 2
    assert message in capsys.readouterr().err


def test_decode_model_config_shrinks_only_what_it_is_asked_to():
    full = decode_model_config("qwen3-2048")
    assert (full["hidden_size"], full["num_hidden_layers"]) == (2048, 28)
    assert full["vocab_size"] == 151936
    shrunk = decode_model_config("qwen3-2048", layers=2, vocab_size=512)
    assert {**shrunk, "num_hidden_layers": 28, "vocab_size": 151936} == full
    with pytest.raises(ValueError, match="unknown decode model"):
        decode_model_config("qwen3-4096")


def test_bench_runs(capsys):
    arguments = ["--quick", "--decode-models", "qwen3-1024", "--decode-steps", "1",
                 "--decode-rounds", "1"]
    assert mlx_lm_bench.main(arguments) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^qwen3-1024 +ms/token +[\d.]+ +[\d.]+ +[\d.]+x", printed, re.M), printed
    assert "greedy tokens, patched vs unpatched, every round: identical" in printed
    assert "median patched / median unpatched time per decode token" in printed


def test_bench_ratio_is_patched_time_over_unpatched_time():
    timing = mlx_lm_bench.PairedTiming("twice as fast", "us/token", [2.0, 4.0], [1.0, 1.0])
    assert timing.time_ratios == [0.5, 0.25]
    assert timing.summary()["time_ratio_patched_over_unpatched"]["median"] == 0.375
