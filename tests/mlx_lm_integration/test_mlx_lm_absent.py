"""Without mlx-lm, importing the integration says what to install, while
``import mlx_dualnorm`` itself never needs mlx-lm. The absence is simulated
in a fresh interpreter with ``sys.modules["mlx_lm"] = None``, which makes
Python's import raise ModuleNotFoundError, as it does where mlx-lm is not
installed."""

from __future__ import annotations

import textwrap

from helpers.isolated_process import describe, run_python

IMPORT_WITHOUT_MLX_LM = textwrap.dedent(
    """
    import sys
    sys.modules["mlx_lm"] = None
    import mlx_dualnorm
    print("PACKAGE", mlx_dualnorm.__name__)
    try:
        from mlx_dualnorm.integrations import mlx_lm
    except ImportError as error:
        print("TYPE", type(error).__name__, isinstance(error, ModuleNotFoundError))
        print("NAME", error.name)
        print("MESSAGE", error)
    """
)


def test_importing_the_integration_without_mlx_lm_says_what_to_install():
    process = run_python(IMPORT_WITHOUT_MLX_LM)
    assert process.returncode == 0, describe(process)
    assert "PACKAGE mlx_dualnorm" in process.stdout, describe(process)
    # Still a ModuleNotFoundError for mlx_lm, as code catching it expects.
    assert "TYPE ModuleNotFoundError True" in process.stdout, describe(process)
    assert "NAME mlx_lm" in process.stdout
    assert "needs mlx-lm, which is not installed" in process.stdout
    assert "pip install 'mlx-lm==0.32.2'" in process.stdout
    assert "supports mlx-lm 0.32.0 to 0.32.2" in process.stdout
