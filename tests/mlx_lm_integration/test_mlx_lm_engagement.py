"""What the patch says it engaged: ``engagement.layer_engagement`` reads the
patch's own record of each attention layer (engaged by prework, or left to
mlx-lm's code with the reason), and ``mlx-lm-check`` prints it for every
synthetic model and for a local model folder."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.usefixtures("unpatched_mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402

from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm import engagement, registry  # noqa: E402
from mlx_dualnorm.commands import mlx_lm_check  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.prework_log import recording_prework  # noqa: E402
from mlx_dualnorm.integrations.mlx_lm.state import STATE  # noqa: E402
from mlx_dualnorm.commands.shared.generation import greedy_generate  # noqa: E402
from mlx_dualnorm.commands.shared import synthetic  # noqa: E402
from helpers.mlx_lm_families import (  # noqa: E402
    SYNTHETIC_MODEL_TYPES,
    build_model,
    build_synthetic_model,
    check_report,
)

QWEN3 = {
    "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 3,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 256,
    "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": True,
}
QWEN3_ATTENTION = "mlx_lm.models.qwen3.Attention"
PROMPT = mx.array([3, 1, 4, 1, 5, 9, 2, 6])


def registered_layers(model: nn.Module) -> int:
    """Layers of a registered attention class, counted by isinstance."""
    classes = tuple(registry.families_by_class())
    return sum(isinstance(module, classes) for _, module in model.named_modules())


def engaged_line(output: str) -> dict[str, int]:
    """The check's ``engaged:`` line as numbers."""
    line = next(line for line in output.splitlines() if line.startswith("  engaged:"))
    return {
        name: int(value)
        for name, value in re.findall(
            r"(gated-delta calls folded|norm-only layers|norm \+ RoPE layers|RoPE-only layers) (\d+)",
            line,
        )
    }


def left_count(output: str) -> int:
    match = re.search(r"^  left to mlx-lm: attention layers (\d+)$", output, re.MULTILINE)
    assert match, output
    return int(match.group(1))


@pytest.mark.parametrize("name", SYNTHETIC_MODEL_TYPES)
def test_check_says_what_it_engaged_on_every_synthetic_model(name, capsys):
    """The package's small models through the command line, the tests' families
    through the same check and report."""
    if name in synthetic.SYNTHETIC_MODEL_TYPES:
        assert mlx_lm_check.main(["--synthetic", name, "--tokens", "3", "--rounds", "1"]) == 0
        output = capsys.readouterr().out
    else:
        identical, output = check_report(name, tokens=3)
        assert identical, output
    assert "RESULT: identical" in output
    counts = engaged_line(output)
    attention_layers = (
        counts["norm-only layers"] + counts["norm + RoPE layers"] + counts["RoPE-only layers"]
    )
    # Every layer of a registered class is counted once, engaged or left.
    assert attention_layers + left_count(output) == registered_layers(build_synthetic_model(name))
    # Every engaged layer's prework was measured (which package call ran in it).
    assert f"{engagement.UNNAMED_PREWORK} layers" not in output
    if attention_layers or counts.get("gated-delta calls folded"):
        assert "changes nothing" not in output
    else:  # what it left, and why, is said
        assert "changes nothing" in output
    if name in ("qwen3_next", "qwen3_5"):  # 3 gated-delta layers, 1 attention layer
        # 3 layers at the prompt and 4 steps (generate_step computes one after the last)
        assert counts["gated-delta calls folded"] == 3 * 5
        assert counts["norm + RoPE layers"] == 1
        assert "    1 norm + RoPE: mlx_lm.models.qwen3_next.Qwen3NextAttention" in output
        assert "normalize_qk:   " in output and " 0 ran mlx-lm's function" in output


def test_check_of_a_model_folder_names_the_engaged_class(tmp_path, capsys):
    """A qwen3 model has no gated-delta layer, yet every attention layer
    runs the package's norm + RoPE: the check says so, by class, not that
    the patch changes nothing."""
    model = build_model(QWEN3, dtype=mx.float32)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    assert mlx_lm_check.main(["--model", str(tmp_path), "--tokens", "4", "--rounds", "1"]) == 0
    output = capsys.readouterr().out
    assert "RESULT: identical" in output
    # No gated-delta layer, so no gated-delta count either.
    assert engaged_line(output) == {
        "norm-only layers": 0, "norm + RoPE layers": 3, "RoPE-only layers": 0
    }
    assert "gated-delta" not in output and "normalize_qk:" not in output
    assert f"    3 norm + RoPE: {QWEN3_ATTENTION}\n" in output
    assert "  left to mlx-lm: attention layers 0\n" in output
    assert "attention layers engaged 3, left to mlx-lm's code 0" in output
    assert "changes nothing" not in output


class OtherRoPE(nn.RoPE):
    """A RoPE that is not exactly nn.RoPE: the patch leaves its layer alone."""


def test_the_record_has_each_layer_once_with_its_reason():
    model = build_model(QWEN3, dtype=mx.float32)
    first, second, third = (layer.self_attn for layer in model.layers)
    second.rope = OtherRoPE(32, base=10000.0)
    assert engagement.layer_engagement(model).left == {(QWEN3_ATTENTION, engagement.NOT_PATCHED): 3}
    with integration.patch(), recording_prework() as kinds:
        record = engagement.layer_engagement(model)
        assert record.left == {(QWEN3_ATTENTION, engagement.NOT_CALLED): 3}
        first(mx.zeros((1, 2, 64)))
        second(mx.zeros((1, 2, 64)))
        unmeasured = engagement.layer_engagement(model)
        record = engagement.layer_engagement(model, kinds.prework_of)
    # Measured: the layer's prework ran one CompiledDualHeadNormRope call.
    assert record.engaged == {(QWEN3_ATTENTION, engagement.NORM_ROPE): 1}
    assert unmeasured.engaged == {(QWEN3_ATTENTION, engagement.UNNAMED_PREWORK): 1}
    assert record.left == {
        (QWEN3_ATTENTION, engagement.NOT_PLAIN + " (rope OtherRoPE, q_norm RMSNorm, k_norm RMSNorm)"): 1,
        (QWEN3_ATTENTION, engagement.NOT_CALLED): 1,
    }
    assert (record.engaged_layers, record.left_layers) == (1, 2)
    assert record.engaged_by_prework() == {engagement.NORM_ROPE: 1}
    assert third is model.layers[2].self_attn
    # Unpatched, every layer has mlx-lm's class back.
    assert engagement.layer_engagement(model).left == {(QWEN3_ATTENTION, engagement.NOT_PATCHED): 3}


def test_a_subclass_of_a_registered_class_is_left_with_its_reason():
    model = build_model(QWEN3, dtype=mx.float32)
    attention_class = type(model.layers[0].self_attn)
    subclass = type("CustomAttention", (attention_class,), {"__module__": __name__})
    layer = model.layers[0].self_attn
    object.__setattr__(layer, "__class__", subclass)
    with integration.patch(), recording_prework() as kinds:
        greedy_generate(model, PROMPT, 2)
        record = engagement.layer_engagement(model, kinds.prework_of)
    assert record.left == {(f"{__name__}.CustomAttention", engagement.SUBCLASS): 1}
    assert record.engaged == {(QWEN3_ATTENTION, engagement.NORM_ROPE): 2}


def test_a_layer_without_rope_is_measured_as_norm_only():
    """llama4_text's NoPE layers run the q/k norm pair alone, its others
    norm + RoPE: the check tells them apart by what ran in each layer."""
    identical, output = check_report("llama4_text", tokens=2)
    assert identical, output
    assert "    1 norm: mlx_lm.models.llama4_text.Attention\n" in output
    assert "    1 norm + RoPE: mlx_lm.models.llama4_text.Attention\n" in output


def test_recording_is_off_outside_its_block():
    """Recording changes nothing of the package or mlx-lm, and records
    nothing once its block has ended."""
    from mlx_dualnorm.integrations.mlx_lm import engine

    model = build_model(QWEN3, dtype=mx.float32)
    with integration.patch():
        with recording_prework() as kinds:
            greedy_generate(model, PROMPT, 1)
        recorded = dict(kinds.by_layer)
        greedy_generate(model, PROMPT, 1)
    assert STATE.prework_log is None
    assert kinds.by_layer == recorded and len(recorded) == 3


def test_fold_count_counts_the_folds_built():
    integration.clear_cache()
    assert engagement.fold_count() == 0
    model = build_synthetic_model("qwen3_5")
    with integration.patch():
        greedy_generate(model, PROMPT, 2)
    assert engagement.fold_count() == 1  # one dtype, width, eps and scale
    integration.clear_cache()
    assert engagement.fold_count() == 0


def test_the_summary_counts_layers_package_calls_and_folded_calls_with_plurals():
    """One full-attention layer and three gated-delta layers: the line says
    "1 attention layer", and its package calls are the attention calls plus
    the normalize_qk calls that ran the fold (not the folds built)."""
    from mlx_dualnorm.commands.shared.generation import greedy_generate
    from helpers.mlx_lm_families import build_synthetic_model

    model = build_synthetic_model("qwen3_next")
    before = integration.report()
    with integration.patch():
        greedy_generate(model, PROMPT, 4)
        report = integration.report()
    engaged = report.engaged_layers - before.engaged_layers
    folded = report.folded_calls - before.folded_calls
    assert engaged == 1 and folded >= 3 * 5
    summary = report.summary()
    assert summary.startswith(f"mlx_dualnorm: {report.engaged_layers} attention layer")
    if report.engaged_layers == 1:
        assert "1 attention layer engaged" in summary
    assert (f"{report.calls + report.folded_calls} package calls ({report.calls} attention "
            f"call{'s' if report.calls != 1 else ''}, {report.folded_calls} folded normalize_qk "
            "calls)") in summary
    assert f"{report.folds} gated-delta fold" in summary
