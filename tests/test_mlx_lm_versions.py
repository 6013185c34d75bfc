"""patch() across mlx-lm releases: on a release without
``gated_delta.normalize_qk`` (0.31.x) it patches the attention classes
whose code is proven to be what its replacements reproduce, greedy output
bit-identical, warns once what it leaves, and raises only where nothing can
be patched, leaving mlx-lm as it was.

On the tested mlx-lm (0.32.2) the older releases are reproduced in a fresh
interpreter by taking away exactly what they lack: mlx-lm 0.31.x ships
``mlx_lm.models.gated_delta`` without ``normalize_qk``, and releases
before gated-delta layers have no such module (``sys.modules[name] =
None`` makes Python's import raise ModuleNotFoundError for it, as it does
where the file is absent). The integration only ever looks for that module
and attribute, so it sees what it would see on those releases; nothing of
MLX is replaced. CI also runs this file with the real mlx-lm 0.31.3 first
on the path, where the same scripts take nothing away.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

pytest.importorskip("mlx_lm")

import mlx_lm.models.gated_delta as gated_delta  # noqa: E402
from isolated_process import describe, run_python  # noqa: E402

INSTALLED_HAS_NORMALIZE_QK = hasattr(gated_delta, "normalize_qk")
on_the_tested_release = pytest.mark.skipif(
    not INSTALLED_HAS_NORMALIZE_QK, reason="the installed mlx-lm is an older release"
)

# gated_delta as mlx-lm 0.31.x ships it (a no-op there). The 0.32.x model
# modules that import normalize_qk are imported first: they keep mlx-lm's
# own function, as 0.31.x's models compute it inline.
AS_MLX_LM_0_31 = """
    import mlx_lm.models.gated_delta as gated_delta
    import mlx_lm.models.qwen3_next
    if hasattr(gated_delta, "normalize_qk"):
        del gated_delta.normalize_qk
"""

GREEDY_PARITY = """
    import warnings
    import mlx_lm
    from mlx_dualnorm.integrations import mlx_lm as integration
    from mlx_dualnorm.integrations.mlx_lm import full_attention
    from mlx_dualnorm.tools.mlx_lm_check import compare_traces, greedy_generate
    from mlx_dualnorm.tools.mlx_lm_synthetic import build_synthetic_model, prompt_token_ids

    from mlx_dualnorm.integrations.mlx_lm import _release_check

    print("MLX_LM", mlx_lm.__version__)
    model = build_synthetic_model("qwen3_next")  # 3 gated-delta layers, 1 full attention
    prompt = prompt_token_ids(512)
    reference = greedy_generate(model, prompt, 24)
    fused_calls = []
    prework = full_attention._prework_and_cache_update

    def counting_prework(*arguments):
        rotated = prework(*arguments)
        fused_calls.append(rotated is not None)
        return rotated

    full_attention._prework_and_cache_update = counting_prework
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        integration.patch()
        integration.patch()
    print("ENGAGED_CLASSES", len(_release_check.registered_classes()))
    print("WARNINGS", len(caught))
    for warning in caught:
        print("WARNING", warning.category.__name__, warning.message)
    patched = greedy_generate(model, prompt, 24)
    print("PATCHED", integration.is_patched())
    print("IDENTICAL", compare_traces(reference, patched).identical)
    print("FUSED", sum(fused_calls), "OF", len(fused_calls))
    print("NORMALIZE_QK", hasattr(gated_delta, "normalize_qk"))
    integration.unpatch()
    print("UNPATCHED", integration.is_patched(), type(model.layers[3].self_attn).__mro__[1].__name__)
"""


def _script(*parts: str) -> str:
    return "".join(textwrap.dedent(part) for part in parts)


def test_without_normalize_qk_full_attention_is_patched_bit_identically() -> None:
    process = run_python(_script(AS_MLX_LM_0_31, GREEDY_PARITY), timeout_s=300)
    assert process.returncode == 0, describe(process)
    output = process.stdout
    assert "PATCHED True" in output and "IDENTICAL True" in output, describe(process)
    # One attention layer: the prompt, then 25 steps (generate_step computes
    # the step after the 24th token too).
    assert "FUSED 26 OF 26" in output, describe(process)
    assert "NORMALIZE_QK False" in output  # nothing added to mlx-lm
    assert "WARNINGS 1" in output, describe(process)  # said once, not per patch()
    assert "WARNING RuntimeWarning [mlx_lm.patch] mlx-lm 0.3" in output
    assert "gated-delta layers run mlx-lm's own code (no fold)" in output
    engaged = int(output.split("ENGAGED_CLASSES ")[1].split()[0])
    assert engaged >= 3  # qwen3, qwen3_moe, qwen3_next: the same code in 0.31.3
    assert f"attention layers of {engaged} classes engage (" in output
    assert "mlx_lm.models.qwen3_next.Qwen3NextAttention" in output
    assert "pip install 'mlx-lm==0.32.2'" in output
    # Unpatching gives the layer mlx-lm's class back: its base is nn.Module.
    assert "UNPATCHED False Module" in output


def test_a_class_whose_code_is_not_proven_is_never_touched() -> None:
    """qwen3's Attention, its fingerprint taken out of the record, stays
    mlx-lm's class with mlx-lm's __call__; the warning names it."""
    process = run_python(
        _script(
            AS_MLX_LM_0_31,
            """
            import warnings
            import mlx_lm.models.qwen3 as qwen3
            from mlx_dualnorm.integrations import mlx_lm as integration
            from mlx_dualnorm.integrations.mlx_lm import _release_check

            del _release_check.PROVEN_CLASS_CODE["mlx_lm.models.qwen3.Attention"]
            original_call = qwen3.Attention.__call__
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                integration.patch()
            print("MESSAGE", caught[0].message)
            print("ENGAGED_CLASSES", len(_release_check.registered_classes()))
            print("UNTOUCHED", qwen3.Attention.__call__ is original_call)
            print("REASON", _release_check.unproven_classes[qwen3.Attention])
            integration.unpatch()
            """,
        )
    )
    assert process.returncode == 0, describe(process)
    output = process.stdout
    assert "UNTOUCHED True" in output, describe(process)
    engaged = int(output.split("ENGAGED_CLASSES ")[1].split()[0])
    assert f"attention layers of {engaged} classes engage (" in output
    engaged_classes = output.split(" engage (")[1].split(")")[0].split(", ")
    assert len(engaged_classes) == engaged
    assert "mlx_lm.models.qwen3.Attention" not in engaged_classes
    left = output.split(" left to mlx-lm, their code differing from what the patch reproduces (")
    assert len(left) == 2, describe(process)
    assert "mlx_lm.models.qwen3.Attention" in left[1].split(")")[0].split(", ")
    assert "REASON its code in this mlx-lm is not the code the patch reproduces" in output


def test_patch_refuses_where_nothing_can_be_patched() -> None:
    process = run_python(
        _script(
            AS_MLX_LM_0_31,
            """
            from mlx_dualnorm.integrations import mlx_lm as integration
            from mlx_dualnorm.integrations.mlx_lm import _release_check, full_attention

            _release_check.PROVEN_CLASS_CODE.clear()  # no class's code is the tested code
            try:
                integration.patch()
            except RuntimeError as error:
                print("REFUSED", error)
            else:
                print("PATCHED", integration.is_patched())
            print("NOTHING_INSTALLED", not full_attention._original_attention_calls)
            print("NORMALIZE_QK", hasattr(gated_delta, "normalize_qk"))
            integration.unpatch()
            print("UNPATCHED", integration.is_patched())
            """,
        )
    )
    assert process.returncode == 0, describe(process)
    output = process.stdout
    assert "REFUSED [mlx_lm.patch] mlx-lm 0.3" in output, describe(process)
    assert "has no mlx_lm.models.gated_delta.normalize_qk" in output
    assert "none of its attention classes has the code the patch reproduces" in output
    assert "supports mlx-lm 0.32.0 to 0.32.2" in output
    assert "pip install 'mlx-lm==0.32.2'" in output
    assert "NOTHING_INSTALLED True" in output and "NORMALIZE_QK False" in output
    assert "UNPATCHED False" in output


@on_the_tested_release
def test_an_mlx_lm_without_gated_delta_layers_gets_full_attention() -> None:
    """No gated_delta module: qwen3_next (which imports it) is not there to
    patch; qwen3 and qwen3_moe are, their code proven."""
    process = run_python(
        """
        import sys, warnings
        import mlx_lm.models.gated_delta
        sys.modules["mlx_lm.models.gated_delta"] = None  # as if the file were absent
        sys.modules.pop("mlx_lm.models.qwen3_next", None)
        from mlx_dualnorm.integrations import mlx_lm as integration
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("PATCHED", integration.patch().patched)
        print("MESSAGE", caught[0].message)
        print("UNPATCHED", integration.unpatch().patched)
        """
    )
    assert process.returncode == 0, describe(process)
    assert "PATCHED True" in process.stdout, describe(process)
    engaged = process.stdout.split(" engage (")[1].split(")")[0].split(", ")
    assert {"mlx_lm.models.qwen3.Attention", "mlx_lm.models.qwen3_moe.Attention"} <= set(engaged)
    assert "mlx_lm.models.qwen3_next.Qwen3NextAttention" not in engaged
    assert "UNPATCHED False" in process.stdout


@on_the_tested_release
def test_patch_on_the_tested_mlx_lm_says_nothing() -> None:
    """The control: the unaltered mlx-lm patches everything, no warning."""
    process = run_python(
        """
        import warnings
        from mlx_dualnorm.integrations import mlx_lm as integration
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            print("PATCHED", integration.patch().patched)
        print("UNPATCHED", integration.unpatch().patched)
        """
    )
    assert process.returncode == 0, describe(process)
    assert "PATCHED True" in process.stdout and "UNPATCHED False" in process.stdout


@on_the_tested_release
def test_every_registered_class_has_its_tested_code_recorded() -> None:
    """The record the older releases are checked against holds the code of
    every registered class as the tested release ships it."""
    from mlx_dualnorm.integrations.mlx_lm import _release_check

    missing = []
    for attention_class in _release_check.registered_classes():
        if not _release_check.is_proven(attention_class):
            fingerprint = _release_check.code_fingerprint(attention_class)
            name = _release_check.class_name(attention_class)
            missing.append(f'    "{name}": frozenset({{"{fingerprint}"}}),')
    assert not missing, "add to PROVEN_CLASS_CODE:\n" + "\n".join(missing)


def _class_from_source(monkeypatch, tmp_path, name: str, source: str) -> type:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # inspect finds a class's source through its module, for the test's length.
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module.Attention


def test_the_fingerprint_is_of_the_code_not_its_formatting(monkeypatch, tmp_path) -> None:
    from mlx_dualnorm.integrations.mlx_lm._release_check import code_fingerprint

    base = """
        class Attention:
            def __call__(self, x, mask=None, cache=None):
                return self.rope(x, offset=cache.offset) * 2
    """
    reformatted = '''
        class Attention:
            """Documented."""

            # a comment
            def __call__(self, x, mask=None, cache=None):
                """Also documented."""
                return self.rope(
                    x, offset=cache.offset
                ) * 2
    '''
    other_constant = base.replace("* 2", "* 3")
    other_argument = base.replace("offset=cache.offset", "offset=0")
    fingerprints = [
        code_fingerprint(_class_from_source(monkeypatch, tmp_path, f"attention_{index}", source))
        for index, source in enumerate((base, reformatted, other_constant, other_argument))
    ]
    assert None not in fingerprints
    assert fingerprints[0] == fingerprints[1]
    assert len(set(fingerprints)) == 3


def test_the_fingerprint_reads_alike_on_every_python() -> None:
    """The parsed code is spelled the same whichever Python parses it:
    fields a Python adds empty (3.12's ``type_params``) or leaves out when
    empty (3.13) never count, so a record taken on one Python proves the
    same code on another. The spelling is pinned: a change to it is a
    change to every recorded fingerprint."""
    import ast

    from mlx_dualnorm.integrations.mlx_lm._release_check import stable_dump

    tree = ast.parse("def step(x, *, scale=2):\n    return x * scale")
    assert stable_dump(tree) == (
        "Module(body=[FunctionDef(name='step', args=arguments(args=[arg(arg='x')], "
        "kwonlyargs=[arg(arg='scale')], kw_defaults=[Constant(value=2)]), "
        "body=[Return(value=BinOp(left=Name(id='x', ctx=Load()), op=Mult(), "
        "right=Name(id='scale', ctx=Load())))])])"
    )
    # A Python that adds a field (as 3.12 added type_params), empty here:
    # the same text; filled: another.
    function = tree.body[0]
    with_new_field = type("FunctionDef", (ast.FunctionDef,), {
        "_fields": (*ast.FunctionDef._fields, "field_of_a_later_python"),
    })
    respelled = with_new_field(**{name: getattr(function, name, None)
                                  for name in ast.FunctionDef._fields})
    respelled.field_of_a_later_python = []
    assert stable_dump(ast.Module(body=[respelled], type_ignores=[])) == stable_dump(tree)
    respelled.field_of_a_later_python = [ast.Name(id="T", ctx=ast.Load())]
    assert stable_dump(ast.Module(body=[respelled], type_ignores=[])) != stable_dump(tree)
    # An f-string with a nested format spec, which 3.12 alone parses with
    # an empty text piece at its end.
    nested = ast.parse('f"{x:>{width}}"')
    format_spec = nested.body[0].value.values[0].format_spec
    padded = ast.parse('f"{x:>{width}}"')
    padded.body[0].value.values[0].format_spec.values = [
        *format_spec.values, ast.Constant(value="")]
    assert stable_dump(padded) == stable_dump(nested)


def test_code_is_tested_follows_the_release() -> None:
    """On the tested release line every class's code is the tested code;
    on an older mlx-lm only a proven class's (here: a cache class whose
    0.31.3 update_and_fetch differs)."""
    process = run_python(
        _script(
            AS_MLX_LM_0_31,
            """
            import mlx_lm.models.cache as cache
            from mlx_dualnorm.integrations.mlx_lm import _release_check
            print("KVCACHE", _release_check.code_is_tested(cache.KVCache))
            print("QUANTIZED", _release_check.code_is_tested(cache.QuantizedKVCache))
            print("TESTED_LINE", _release_check._TESTED_RELEASE_LINE)
            """,
        )
    )
    assert process.returncode == 0, describe(process)
    output = process.stdout
    assert "TESTED_LINE False" in output, describe(process)
    # QuantizedKVCache has no recorded code: never proven on an older release.
    assert "QUANTIZED False" in output
    # KVCache is proven where its code is 0.32.2's (the simulation), not on 0.31.3.
    expected = "True" if INSTALLED_HAS_NORMALIZE_QK else "False"
    assert f"KVCACHE {expected}" in output


def test_a_layer_whose_mlx_lm_part_is_not_proven_is_left() -> None:
    """step3p5's layers normalize with the model file's ZeroCenteredRMSNorm,
    whose math the replacement reproduces: with that class's tested code
    taken out of the record, an older mlx-lm leaves the layers to mlx-lm's
    code (the attention class itself still proven), bits unchanged."""
    from mlx_dualnorm.tools.mlx_lm_synthetic import SYNTHETIC_MODEL_TYPES

    if "step3p5" not in SYNTHETIC_MODEL_TYPES:
        pytest.skip("no step3p5 family registered")
    process = run_python(
        _script(
            AS_MLX_LM_0_31,
            """
            import warnings
            from mlx_dualnorm.integrations import mlx_lm as integration
            from mlx_dualnorm.integrations.mlx_lm import _release_check
            from mlx_dualnorm.integrations.mlx_lm.engagement import layer_engagement
            from mlx_dualnorm.tools.mlx_lm_check import compare_traces, greedy_generate
            from mlx_dualnorm.tools.mlx_lm_synthetic import build_synthetic_model, prompt_token_ids

            model = build_synthetic_model("step3p5")
            prompt = prompt_token_ids(256, 6)
            warnings.simplefilter("ignore")
            for taken_out in (False, True):
                if taken_out:
                    del _release_check.PROVEN_CLASS_CODE["mlx_lm.models.step3p5.ZeroCenteredRMSNorm"]
                    _release_check._tested_verdicts.clear()
                reference = greedy_generate(model, prompt, 4)
                with integration.patch():
                    patched = greedy_generate(model, prompt, 4)
                    record = layer_engagement(model)
                print("TAKEN_OUT", taken_out, "ENGAGED", record.engaged_layers,
                      "IDENTICAL", compare_traces(reference, patched).identical)
                print("LEFT", sorted(reason for _, reason in record.left))
            """,
        ),
        timeout_s=300,
    )
    assert process.returncode == 0, describe(process)
    output = process.stdout
    engaged_before = int(output.split("TAKEN_OUT False ENGAGED ")[1].split()[0])
    assert engaged_before > 0, describe(process)
    assert "TAKEN_OUT True ENGAGED 0 IDENTICAL True" in output, describe(process)
    assert "IDENTICAL False" not in output
    assert "a part of it (a norm or RoPE of mlx-lm's) is not the tested code" in output


def test_a_layer_of_mlx_parts_only_needs_no_record() -> None:
    import mlx.nn as nn

    from mlx_dualnorm.integrations.mlx_lm._release_check import parts_are_tested

    layer = nn.Module()
    layer.q_norm, layer.rope = nn.RMSNorm(8), nn.RoPE(8)
    assert parts_are_tested(layer)
