"""patch() across mlx-lm releases, and the proof it rests on: every piece
of code a replacement restates must be, as the program resolves it now,
the recorded code (registry.RECORDED_CODE); on a release without
``gated_delta.normalize_qk`` (0.31.x) the proven attention classes are
patched, greedy output bit-identical, the patch warns once what it leaves,
and raises only where nothing can be patched, leaving mlx-lm as it was.

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
from helpers.isolated_process import describe, run_python  # noqa: E402

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
    from mlx_dualnorm.integrations.mlx_lm import engine, qwen3
    from mlx_dualnorm.commands.shared.generation import compare_traces, greedy_generate
    from helpers.mlx_lm_families import build_synthetic_model, prompt_token_ids

    print("MLX_LM", mlx_lm.__version__)
    model = build_synthetic_model("qwen3_next")  # 3 gated-delta layers, 1 full attention
    prompt = prompt_token_ids(512)
    reference = greedy_generate(model, prompt, 24)
    fused_calls = []
    prework = qwen3._prework_and_cache_update

    def counting_prework(*arguments):
        rotated = prework(*arguments)
        fused_calls.append(rotated is not None)
        return rotated

    qwen3._prework_and_cache_update = counting_prework
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        integration.patch()
        integration.patch()
    print("ENGAGED_CLASSES", len(engine.patched_classes()))
    print("WARNINGS", len(caught))
    for warning in caught:
        print("WARNING", warning.category.__name__, warning.message)
    patched = greedy_generate(model, prompt, 24)
    print("PATCHED", integration.is_patched())
    print("IDENTICAL", compare_traces(reference, patched).identical)
    print("FUSED", sum(fused_calls), "OF", len(fused_calls))
    print("NORMALIZE_QK", hasattr(gated_delta, "normalize_qk"))
    integration.unpatch()
    attention = model.layers[3].self_attn
    print("UNPATCHED", integration.is_patched(), engine.decision_of(attention),
          type(attention).__call__ is engine.unpatched_function(type(attention), "__call__"))
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
    assert "mlx_lm.models.gated_delta.normalize_qk: absent: gated-delta layers run" in output
    engaged = int(output.split("ENGAGED_CLASSES ")[1].split()[0])
    assert engaged >= 3  # qwen3, qwen3_moe, qwen3_next: the same code in 0.31.3
    # Unpatching drops the layer's decision and gives the class its own code.
    assert "UNPATCHED False None True" in output


def warning_lines(output: str) -> dict[str, str]:
    """The classes the patch's warning lists, each with what differs."""
    lines = output.split("MESSAGE ", 1)[1].split("\nEND", 1)[0].splitlines()[1:]
    return dict(line.strip().split(": ", 1) for line in lines if line.startswith("  "))


def test_a_class_whose_code_is_not_proven_is_never_touched() -> None:
    """qwen3's Attention, its __call__'s fingerprint taken out of the
    record, keeps mlx-lm's __call__; the warning names it on a line of its
    own, with the piece that differs, and no source text."""
    process = run_python(
        _script(
            AS_MLX_LM_0_31,
            """
            import warnings
            import mlx_lm.models.qwen3 as qwen3
            from mlx_dualnorm.integrations import mlx_lm as integration
            from mlx_dualnorm.integrations.mlx_lm import engine, registry

            del registry.RECORDED_CODE["mlx_lm.models.qwen3.Attention.__call__"]
            original_call = qwen3.Attention.__call__
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                integration.patch()
            print("MESSAGE", caught[0].message)
            print("END")
            print("ENGAGED_CLASSES", len(engine.patched_classes()))
            print("UNTOUCHED", qwen3.Attention.__call__ is original_call)
            print("REPORTED", [entry.unproven for entry in integration.report().classes
                               if entry.name == "mlx_lm.models.qwen3.Attention"])
            integration.unpatch()
            """,
        )
    )
    assert process.returncode == 0, describe(process)
    output = process.stdout
    assert "UNTOUCHED True" in output, describe(process)
    assert int(output.split("ENGAGED_CLASSES ")[1].split()[0]) >= 2
    left = warning_lines(output)
    assert left["mlx_lm.models.qwen3.Attention"] == "__call__", describe(process)
    message = output.split("MESSAGE ", 1)[1].split("\nEND", 1)[0]
    assert all(len(line) < 120 for line in message.splitlines()[1:]), message
    assert "REPORTED [('__call__',)]" in output


def test_patch_refuses_where_nothing_can_be_patched() -> None:
    process = run_python(
        _script(
            AS_MLX_LM_0_31,
            """
            from mlx_dualnorm.integrations import mlx_lm as integration
            from mlx_dualnorm.integrations.mlx_lm import engine, registry

            registry.RECORDED_CODE.clear()  # none of the code is the tested code
            try:
                integration.patch()
            except RuntimeError as error:
                print("REFUSED", error)
            else:
                print("PATCHED", integration.is_patched())
            print("NOTHING_INSTALLED", not engine.patched_classes())
            print("NORMALIZE_QK", hasattr(gated_delta, "normalize_qk"))
            print("STATE", integration.is_patched())
            integration.unpatch()
            print("UNPATCHED", integration.is_patched())
            """,
        )
    )
    assert process.returncode == 0, describe(process)
    output = process.stdout
    assert "REFUSED [mlx_lm.patch] mlx-lm 0.3" in output, describe(process)
    assert "has none of the code the patch was proven on" in output
    assert "supports mlx-lm 0.32.0 to 0.32.2" in output
    assert "pip install 'mlx-lm==0.32.2'" in output
    assert "NOTHING_INSTALLED True" in output and "NORMALIZE_QK False" in output
    assert "STATE False" in output  # a refused patch leaves the state as it was
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
        from mlx_dualnorm.integrations.mlx_lm import engine, registry
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("PATCHED", integration.patch().patched)
        print("ENGAGED", sorted(registry.class_name(cls) for cls in engine.patched_classes()))
        print("UNPATCHED", integration.unpatch().patched)
        """
    )
    assert process.returncode == 0, describe(process)
    assert "PATCHED True" in process.stdout, describe(process)
    engaged = process.stdout.split("ENGAGED ")[1].split("\n")[0]
    assert "'mlx_lm.models.qwen3.Attention'" in engaged
    assert "'mlx_lm.models.qwen3_moe.Attention'" in engaged
    assert "qwen3_next" not in engaged
    assert "UNPATCHED False" in process.stdout


@on_the_tested_release
def test_patch_on_the_tested_mlx_lm_says_nothing() -> None:
    """The control: the unaltered mlx-lm patches everything, no warning."""
    process = run_python(
        """
        import warnings
        from mlx_dualnorm.integrations import mlx_lm as integration
        from mlx_dualnorm.integrations.mlx_lm import engine, registry
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            print("PATCHED", integration.patch().patched)
        print("ALL", len(engine.patched_classes()) == len(registry.families_by_class()))
        print("UNPATCHED", integration.unpatch().patched)
        """
    )
    assert process.returncode == 0, describe(process)
    assert "PATCHED True" in process.stdout and "UNPATCHED False" in process.stdout
    assert "ALL True" in process.stdout


@on_the_tested_release
def test_every_registered_piece_has_its_tested_code_recorded() -> None:
    """The record holds the code of every piece the registry names, as the
    tested release ships it: the lines to add are printed for a newly
    registered family (docs/mlx-lm.md, "Adding a family")."""
    from mlx_dualnorm.integrations.mlx_lm import engine, registry
    from mlx_dualnorm.integrations.mlx_lm.fingerprints import function_fingerprint

    pieces = engine.registered_pieces()
    assert len(pieces) >= 50
    missing = [
        f'    "{piece}": frozenset({{"{function_fingerprint(function)}"}}),'
        for piece, function in pieces
        if not registry.is_proven_function(piece, function)
    ]
    assert not missing, "add to registry.RECORDED_CODE:\n" + "\n".join(missing)


@on_the_tested_release
def test_no_changed_piece_is_proven() -> None:
    """The inverse: each registered piece with one constant of its source
    changed, compiled in its own module's namespace (so nothing else
    differs), is not proven; nor is a wrapper made with functools.wraps."""
    import functools
    import types

    from mlx_dualnorm.integrations.mlx_lm import engine, registry

    changed_pieces = 0
    for piece, function in engine.registered_pieces():
        assert isinstance(function, types.FunctionType), piece
        assert registry.is_proven_function(piece, function), piece

        @functools.wraps(function)
        def wrapper(*arguments, _function=function, **keywords):
            return _function(*arguments, **keywords)

        assert not registry.is_proven_function(piece, wrapper), piece
        changed = _changed_copy(function)
        if changed is not None:
            assert not registry.is_proven_function(piece, changed), piece
            changed_pieces += 1
    assert changed_pieces >= 40


def _changed_copy(function):
    """``function`` with its first number constant changed (or ``+ 0`` on
    its first return), compiled from its own file's name into a copy of its
    module's namespace: the same name and place, other code. None where it
    has neither."""
    import ast
    import inspect

    source = textwrap.dedent(inspect.getsource(function.__code__))
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            node.value = node.value + 1
            break
    else:
        for node in ast.walk(tree):
            if isinstance(node, ast.Return) and node.value is not None:
                node.value = ast.BinOp(node.value, ast.Add(), ast.Constant(0))
                break
        else:
            return None
    namespace = dict(function.__globals__)
    code = compile(ast.fix_missing_locations(tree), function.__code__.co_filename, "exec")
    exec(code, namespace)
    changed = namespace[function.__name__]
    changed.__qualname__ = function.__qualname__
    changed.__module__ = function.__module__
    return changed


def _function_from_source(monkeypatch, tmp_path, name: str, source: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # inspect finds a function's source through its module, for the test's length.
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module.Attention.__call__


def test_the_fingerprint_is_of_the_code_not_its_formatting(monkeypatch, tmp_path) -> None:
    from mlx_dualnorm.integrations.mlx_lm.fingerprints import function_fingerprint

    base = """
        import math

        class Attention:
            def __call__(self, x, mask=None, cache=None):
                return self.rope(x, offset=cache.offset) * math.sqrt(2)
    """
    reformatted = '''
        import math

        class Attention:
            """Documented."""

            # a comment
            def __call__(self, x, mask=None, cache=None):
                """Also documented."""
                return self.rope(
                    x, offset=cache.offset
                ) * math.sqrt(2)
    '''
    other_constant = base.replace("sqrt(2)", "sqrt(3)")
    other_argument = base.replace("offset=cache.offset", "offset=0")
    fingerprints = [
        function_fingerprint(
            _function_from_source(monkeypatch, tmp_path, f"attention_{index}", source)
        )
        for index, source in enumerate((base, reformatted, other_constant, other_argument))
    ]
    assert None not in fingerprints
    assert fingerprints[0] == fingerprints[1]
    assert len(set(fingerprints)) == 3


def test_a_function_whose_file_changed_since_import_has_no_fingerprint(
    monkeypatch, tmp_path
) -> None:
    """The source read must compile to the code that runs: a file edited on
    disk after the import proves nothing, though the new text parses."""
    import linecache

    from mlx_dualnorm.integrations.mlx_lm.fingerprints import function_fingerprint

    source = """
        class Attention:
            def __call__(self, x, mask=None, cache=None):
                return x * 2
    """
    function = _function_from_source(monkeypatch, tmp_path, "attention_edited", source)
    assert function_fingerprint(function) is not None
    (tmp_path / "attention_edited.py").write_text(textwrap.dedent(source.replace("* 2", "* 3")))
    linecache.checkcache()
    assert function_fingerprint(function) is None


def test_the_fingerprint_reads_alike_on_every_python() -> None:
    """The parsed code is spelled the same whichever Python parses it:
    fields a Python adds empty (3.12's ``type_params``) or leaves out when
    empty (3.13) never count, so a record taken on one Python proves the
    same code on another. The spelling is pinned: a change to it is a
    change to every recorded fingerprint."""
    import ast

    from mlx_dualnorm.integrations.mlx_lm.fingerprints import stable_dump

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


def test_proof_follows_the_live_code_on_every_release() -> None:
    """A cache class is proven by its own code, whatever the release: on the
    simulation of 0.31.x (0.32.2's code less normalize_qk) KVCache is
    proven; on the real mlx-lm 0.31.3 (whose update_and_fetch differs) it
    is not. QuantizedKVCache has no record: never proven."""
    process = run_python(
        _script(
            AS_MLX_LM_0_31,
            """
            import mlx_lm.models.cache as cache
            from mlx_dualnorm.integrations.mlx_lm import registry
            def proven(cache_class):
                return not registry.unproven_attributes(cache_class, ("update_and_fetch",))
            print("KVCACHE", proven(cache.KVCache))
            print("QUANTIZED", proven(cache.QuantizedKVCache))
            """,
        )
    )
    assert process.returncode == 0, describe(process)
    output = process.stdout
    assert "QUANTIZED False" in output, describe(process)
    expected = "True" if INSTALLED_HAS_NORMALIZE_QK else "False"
    assert f"KVCACHE {expected}" in output


def test_a_layer_whose_part_is_not_proven_is_left() -> None:
    """step3p5's layers normalize with the model file's ZeroCenteredRMSNorm,
    whose math the replacement computes itself: with that class's code
    taken out of the record, the layers run mlx-lm's code (the attention
    class itself still patched), bits unchanged, the part named."""
    from helpers.mlx_lm_families import SYNTHETIC_MODEL_TYPES

    assert "step3p5" in SYNTHETIC_MODEL_TYPES  # the small model the script below builds
    process = run_python(
        _script(
            AS_MLX_LM_0_31,
            """
            import warnings
            from mlx_dualnorm.integrations import mlx_lm as integration
            from mlx_dualnorm.integrations.mlx_lm import registry
            from mlx_dualnorm.integrations.mlx_lm.engagement import layer_engagement
            from mlx_dualnorm.commands.shared.generation import compare_traces, greedy_generate
            from helpers.mlx_lm_families import build_synthetic_model, prompt_token_ids

            model = build_synthetic_model("step3p5")
            prompt = prompt_token_ids(256, 6)
            warnings.simplefilter("ignore")
            for taken_out in (False, True):
                if taken_out:
                    del registry.RECORDED_CODE[
                        "mlx_lm.models.step3p5.ZeroCenteredRMSNorm.__call__"]
                    registry.forget_verdicts()
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
    assert "runs code the patch was not proven on" in output
    assert "mlx_lm.models.step3p5.ZeroCenteredRMSNorm" in output


@on_the_tested_release
def test_mlx_s_own_norm_and_rope_are_recorded_too() -> None:
    """A layer of MLX's nn.RMSNorm and nn.RoPE engages only where their
    __call__ is MLX's (the package is built for one MLX release)."""
    import mlx.nn as nn

    from mlx_dualnorm.integrations.mlx_lm import registry

    assert not registry.unproven_attributes(nn.RMSNorm, ("__call__",))
    assert not registry.unproven_attributes(nn.RoPE, ("__call__",))
