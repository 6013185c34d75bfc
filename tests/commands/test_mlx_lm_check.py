"""mlx-lm-check on a synthetic model and on a local model folder: the
RESULT line, a divergence reported with exit status 1, refused arguments
with exit status 2."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402

from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import gated_delta as fold_module  # noqa: E402
from mlx_dualnorm.commands import mlx_lm_check  # noqa: E402
from helpers.mlx_lm_families import (  # noqa: E402
    build_synthetic_model,
    synthetic_model_config,
)

ORIGINAL = integration.ORIGINAL_NORMALIZE_QK


def test_check_passes_on_a_synthetic_model(capsys):
    assert mlx_lm_check.main(["--synthetic", "qwen3_5", "--tokens", "8"]) == 0
    output = capsys.readouterr().out
    assert "RESULT: identical" in output
    assert "bit-identical at all 9 steps" in output
    assert "patched / unpatched" in output and "lower is better" in output


def test_check_loads_a_local_model_folder(tmp_path, capsys):
    model = build_synthetic_model("qwen3_5")
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(synthetic_model_config("qwen3_5")))
    assert mlx_lm_check.main(["--model", str(tmp_path), "--tokens", "4"]) == 0
    assert "RESULT: identical" in capsys.readouterr().out


def test_check_reports_a_divergence(monkeypatch, capsys):
    def off_by_one_ulp(queries, keys, inv_scale, eps, mode):
        normalized_queries, normalized_keys = ORIGINAL(queries, keys, inv_scale=inv_scale, eps=eps)
        return normalized_queries * (1 + 2.0**-7), normalized_keys

    monkeypatch.setattr(fold_module, "_normalize_qk", off_by_one_ulp)
    assert mlx_lm_check.main(["--synthetic", "qwen3_5", "--tokens", "4"]) == 1
    output = capsys.readouterr().out
    assert "RESULT: DIVERGED" in output and "the PATCH changed the output" in output


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--model", "/no/such/model/folder"], "no model folder"),
        (["--model", "."], "no config.json"),
        (["--synthetic", "qwen3_5", "--mode", "no-such-mode"], "mode"),
        (["--synthetic", "qwen3_5", "--prompt", "hello"], "--prompt needs --model"),
    ],
)
def test_check_refuses_bad_arguments(tmp_path, monkeypatch, capsys, arguments, message):
    monkeypatch.chdir(tmp_path)
    assert mlx_lm_check.main(arguments) == 2
    assert message in capsys.readouterr().err
