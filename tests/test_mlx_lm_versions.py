"""patch() on an mlx-lm without ``gated_delta.normalize_qk`` raises, naming
the supported mlx-lm releases, and leaves mlx-lm as it was.

The older releases are reproduced with the real mlx-lm 0.32.2, in a fresh
interpreter, by taking away exactly what they lack: mlx-lm 0.31.x ships
``mlx_lm.models.gated_delta`` without ``normalize_qk`` (first test), and
releases before gated-delta layers have no such module (second test, where
``sys.modules[name] = None`` makes Python's import raise
ModuleNotFoundError for it, as it does where the file is absent). The
integration only ever looks for that module and attribute, so it sees what
it would see on those releases; nothing of MLX is replaced.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("mlx_lm")

from isolated_process import describe, run_python  # noqa: E402

CHECK_REFUSAL = textwrap.dedent(
    """
    from mlx_dualnorm.integrations import mlx_lm as integration
    try:
        integration.patch()
    except RuntimeError as error:
        print("REFUSED", error)
    else:
        print("PATCHED", integration.is_patched())
    integration.unpatch()
    print("UNPATCHED", integration.is_patched())
"""
)


def _assert_refused(process) -> None:
    assert process.returncode == 0, describe(process)
    assert "REFUSED [mlx_lm.patch] mlx-lm 0.32.2 has no" in process.stdout, describe(
        process
    )
    assert "supports mlx-lm 0.32.0 to 0.32.2" in process.stdout
    assert "pip install 'mlx-lm==0.32.2'" in process.stdout
    assert "UNPATCHED False" in process.stdout


def test_patch_refuses_mlx_lm_without_normalize_qk() -> None:
    take_normalize_qk_away = """
        import mlx_lm.models.gated_delta as gated_delta
        original_rms_norm = gated_delta.mx.fast.rms_norm
        del gated_delta.normalize_qk
    """
    check_unchanged = """
        assert not hasattr(gated_delta, "normalize_qk"), "patch() must not add it"
        assert gated_delta.mx.fast.rms_norm is original_rms_norm
        print("UNCHANGED")
    """
    process = run_python(
        textwrap.dedent(take_normalize_qk_away) + CHECK_REFUSAL + textwrap.dedent(check_unchanged)
    )
    assert "UNCHANGED" in process.stdout, describe(process)
    _assert_refused(process)


def test_patch_refuses_mlx_lm_without_gated_delta_module() -> None:
    process = run_python(
        """
        import sys
        import mlx_lm.models.gated_delta
        sys.modules["mlx_lm.models.gated_delta"] = None  # as if the file were absent
        from mlx_dualnorm.integrations import mlx_lm as integration
        try:
            integration.patch()
        except RuntimeError as error:
            print("REFUSED", error)
        print("UNPATCHED", integration.unpatch().patched)
        """
    )
    assert process.returncode == 0, describe(process)
    assert "REFUSED [mlx_lm.patch] mlx-lm 0.32.2 has no" in process.stdout, describe(
        process
    )
    assert "UNPATCHED False" in process.stdout


def test_patch_works_on_the_supported_mlx_lm() -> None:
    """The control: the same script on the unaltered mlx-lm patches."""
    process = run_python(CHECK_REFUSAL)
    assert process.returncode == 0, describe(process)
    assert "PATCHED True" in process.stdout, describe(process)
    assert "UNPATCHED False" in process.stdout
