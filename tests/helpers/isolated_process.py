"""Runs Python code in a fresh interpreter, for what one process cannot
undo or survive: process-wide MLX settings read at start-up
(MLX_DISABLE_COMPILE), a PATH without a compiler, interpreter exit with
live objects, and inputs that crash MLX itself."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Mapping, Optional, Sequence

# The tests folder (this module's package is in it): on every fresh
# interpreter's PYTHONPATH, so its code imports ``helpers.<module>`` too.
TESTS_DIR = pathlib.Path(__file__).resolve().parents[1]


def run_python(
    code: str,
    *,
    env_overrides: Optional[Mapping[str, Optional[str]]] = None,
    timeout_s: float = 120.0,
    importable: Sequence[pathlib.Path] = (),
) -> subprocess.CompletedProcess:
    """Runs ``code`` with this interpreter, the tests folder (and the
    folders in ``importable``: a test module's own, say) importable, and
    the environment changed by ``env_overrides`` (None removes a variable).
    Returns the finished process; stdout and stderr are text."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS_DIR), *map(str, importable), *filter(None, [environment.get("PYTHONPATH")])]
    )
    environment.setdefault("PYTHONFAULTHANDLER", "1")
    for name, value in (env_overrides or {}).items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=str(TESTS_DIR),
    )


def path_without(program: str) -> str:
    """PATH with every folder that holds ``program`` left out."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(
        folder for folder in folders if folder and not (pathlib.Path(folder) / program).exists()
    )


def describe(process: subprocess.CompletedProcess) -> str:
    """The exit status and the output tails, for assertion messages."""
    return (
        f"exit status {process.returncode}\n--- stdout ---\n{process.stdout[-4000:]}"
        f"\n--- stderr ---\n{process.stderr[-4000:]}"
    )
