"""The ``mlx-lm-dualnorm`` console script and ``python -m
mlx_dualnorm.mlx_lm`` are the same command in every failure: the same one
line on stderr and the same exit status, where the package refuses to
load (an MLX other than the one it was built for) and where the command
refuses its own flags.

The script is written here as pip writes a console script, from the
entry point the installed package declares, and run with this
interpreter; the refusing package is a copy of the one imported here with
only its build record changed (as tests/facade/test_mlx_version_guard.py
does)."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import mlx_dualnorm

pytest.importorskip("mlx_lm")

SCRIPT_NAME = "mlx-lm-dualnorm"
PACKAGE_DIR = pathlib.Path(mlx_dualnorm.__file__).resolve().parent
# pip's console-script template: import the entry point, then call it.
SCRIPT_TEMPLATE = """# -*- coding: utf-8 -*-
import re
import sys
from {module} import {function}
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit({function}())
"""


def _entry_point() -> importlib.metadata.EntryPoint:
    scripts = importlib.metadata.entry_points(group="console_scripts", name=SCRIPT_NAME)
    if not scripts:
        pytest.skip(f"no {SCRIPT_NAME} entry point installed (not a pip install)")
    (script,) = scripts
    return script


def _write_script(folder: pathlib.Path) -> pathlib.Path:
    module, function = _entry_point().value.split(":")
    script = folder / "bin" / SCRIPT_NAME
    script.parent.mkdir(parents=True)
    script.write_text(SCRIPT_TEMPLATE.format(module=module.strip(), function=function.strip()))
    return script


def _run(command: list[str], site: pathlib.Path | None, cwd: pathlib.Path):
    environment = dict(os.environ)
    if site is not None:
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(site), environment.get("PYTHONPATH")])
        )
    return subprocess.run(
        command, env=environment, cwd=str(cwd), capture_output=True, text=True, timeout=120
    )


def _both(arguments: list[str], tmp_path: pathlib.Path, site: pathlib.Path | None):
    script = _write_script(tmp_path)
    cwd = site or tmp_path
    as_module = _run([sys.executable, "-m", "mlx_dualnorm.mlx_lm", *arguments], site, cwd)
    as_script = _run([sys.executable, str(script), *arguments], site, cwd)
    return as_module, as_script


def _one_line_exit_2(process) -> None:
    assert process.returncode == 2, process.stderr[-3000:]
    assert process.stderr.count("\n") == 1 and "Traceback" not in process.stderr, process.stderr
    assert process.stdout == ""


def test_a_package_that_refuses_to_load_is_one_line_and_exit_2_both_ways(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(PACKAGE_DIR, site / "mlx_dualnorm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # Built for another backend than the one installed: the guard refuses.
    (site / "mlx_dualnorm" / "_built_against.py").write_text(
        "MLX_VERSION = '0.0.1'\nMLX_BACKEND = 'cuda13'\n"
    )
    as_module, as_script = _both(["generate", "--help"], tmp_path, site)
    _one_line_exit_2(as_module)
    assert "[import mlx_dualnorm]" in as_module.stderr
    _one_line_exit_2(as_script)
    assert as_script.stderr == as_module.stderr


def test_a_bad_flag_of_the_wrapper_is_the_same_line_both_ways(tmp_path):
    as_module, as_script = _both(["--dualnorm-mode", "bogus", "generate"], tmp_path, None)
    _one_line_exit_2(as_module)
    assert (as_script.returncode, as_script.stderr) == (as_module.returncode, as_module.stderr)
