"""Every install line of the documents works as written on a fresh machine.

On Linux MLX runs only with a backend (``mlx[cpu]`` or ``mlx[cuda13]``),
which no other extra brings: a line that installs the package names exactly
one backend extra, ``cuda13`` with the build setting that compiles against
it, and installs from the repository's folder (no package index carries the
package). A line that installs the build's own requirements (for a build
without isolation) asks for the ranges the build declares.

Then each backend's install is resolved by pip against the registry, as the
lines ask for it (``pip install --dry-run``, which fetches only metadata: the
CUDA wheels are gigabytes): the package's dependencies, every extra the
documents install with that backend, and what the build installs for it.
The resolution must succeed and bring that backend's MLX, and no other.
README.md's set-up line itself runs as written in CI (.ci/run), the CPU
one; a CUDA install needs a GPU to import.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shlex
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="not a source tree")

BACKEND_SETTING = "MLX_DUALNORM_BACKEND"
# Each backend extra and the distribution that holds its libmlx.so.
BACKEND_DISTRIBUTIONS = {"cpu": "mlx-cpu", "cuda13": "mlx-cuda-13"}
INLINE_CODE = re.compile(r"`([^`]+)`")


def documents() -> list[pathlib.Path]:
    """The documents a user installs from; docs/results/ are records of
    past runs, quoted as they ran."""
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


class InstallCommand(NamedTuple):
    where: str
    environment: dict[str, str]
    options: list[str]
    targets: list[str]


def _commands_in(text: str) -> list[str]:
    """Shell text of code blocks (each line) and inline code spans (each
    on one line)."""
    found, in_code = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif in_code:
            found.append(line)
        else:
            found.extend(INLINE_CODE.findall(line))
    return found


def install_commands() -> list[InstallCommand]:
    commands = []
    for document in documents():
        for shell in _commands_in(document.read_text(encoding="utf-8")):
            if "pip install" not in shell or "..." in shell:
                continue
            for command in re.split(r"&&|;|\|\|", shell):
                words = shlex.split(command, comments=True)
                if "install" not in words or not any(word.endswith("pip") for word in words):
                    continue
                pip_at = next(i for i, word in enumerate(words) if word.endswith("pip"))
                environment = dict(word.split("=", 1) for word in words[:pip_at] if "=" in word)
                arguments = words[words.index("install", pip_at) + 1 :]
                options = [word for word in arguments if word.startswith("-")]
                targets = [word for word in arguments if not word.startswith("-")]
                where = f"{document.relative_to(ROOT)}: {command.strip()}"
                commands.append(InstallCommand(where, environment, options, targets))
    return commands


def _is_the_package(target: str) -> bool:
    return re.match(r"^(\.|mlx[_-]dualnorm)(\[|$)", target) is not None


def package_installs() -> list[tuple[InstallCommand, set[str]]]:
    """Each command installing the package, with the extras it names."""
    found = []
    for command in install_commands():
        for target in command.targets:
            if _is_the_package(target):
                extras = re.search(r"\[([^\]]*)\]", target)
                found.append((command, set(extras[1].split(",")) if extras else set()))
    return found


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _build_backend():
    spec = importlib.util.spec_from_file_location("mlx_dualnorm_build_backend", ROOT / "build_backend.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    pytest.importorskip("setuptools", reason="build_backend.py imports setuptools' backend")
    spec.loader.exec_module(module)
    return module


def test_the_documents_have_install_lines_for_each_backend() -> None:
    backends = {extra for _, extras in package_installs() for extra in extras} & set(BACKEND_DISTRIBUTIONS)
    assert backends == set(BACKEND_DISTRIBUTIONS)
    where = {command.where.split(":")[0] for command, _ in package_installs()}
    assert {"README.md", "docs/mlx-lm.md", "docs/cuda-build.md"} <= where, where


@pytest.mark.parametrize("install", package_installs(), ids=lambda install: install[0].where)
def test_each_install_line_names_one_backend_and_installs_from_the_folder(install) -> None:
    command, extras = install
    (target,) = [target for target in command.targets if _is_the_package(target)]
    assert target.startswith("."), (
        f"{command.where}: installs the package by name from an index; it is installed "
        "from the repository's folder"
    )
    declared = set(_pyproject()["project"]["optional-dependencies"])
    assert extras <= declared, f"{command.where}: no extra {sorted(extras - declared)}"
    backends = extras & set(BACKEND_DISTRIBUTIONS)
    assert len(backends) == 1, (
        f"{command.where}: names {sorted(backends) or 'no'} MLX backend extra; MLX on Linux "
        f"needs exactly one of {sorted(BACKEND_DISTRIBUTIONS)}"
    )
    (backend,) = backends
    assert command.environment.get(BACKEND_SETTING, "cpu") == backend, (
        f"{command.where}: the {backend} extra installs that MLX, but the build compiles "
        f"against {command.environment.get(BACKEND_SETTING, 'cpu')} ({BACKEND_SETTING})"
    )


def test_build_requirement_lines_ask_for_the_build_s_ranges() -> None:
    import packaging.requirements as packaging_requirements  # a dependency of the test tools
    build = _pyproject()["build-system"]["requires"] + [
        requirement
        for requirements in _build_backend().MLX_BUILD_REQUIREMENTS.values()
        for requirement in requirements
    ]
    declared = {}
    for requirement in map(packaging_requirements.Requirement, build):
        declared.setdefault(requirement.name, set()).add(str(requirement.specifier))
    checked = 0
    for command in install_commands():
        for target in command.targets:
            if _is_the_package(target) or target.startswith("."):
                continue
            requirement = packaging_requirements.Requirement(target)
            if requirement.name in declared and requirement.name != "mlx":
                assert str(requirement.specifier) in declared[requirement.name], (
                    f"{command.where}: {target}, where the build requires "
                    f"{requirement.name}{' or '.join(sorted(declared[requirement.name]))}"
                )
                checked += 1
    assert checked >= 3  # docs/cuda-build.md's build without isolation


def _resolve(requirements: list[str], report: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--disable-pip-version-check", "--report", str(report), *requirements],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def test_each_backend_s_install_resolves_with_that_backend(tmp_path: pathlib.Path) -> None:
    project = _pyproject()
    extras_by_backend: dict[str, set[str]] = {}
    for _, extras in package_installs():
        for backend in extras & set(BACKEND_DISTRIBUTIONS):
            extras_by_backend.setdefault(backend, set()).update(extras)
    build_requirements = _build_backend().MLX_BUILD_REQUIREMENTS
    runs = {}
    for backend, extras in sorted(extras_by_backend.items()):
        requirements = list(project["project"]["dependencies"])
        for extra in sorted(extras):
            requirements += project["project"]["optional-dependencies"][extra]
        requirements += project["build-system"]["requires"] + build_requirements[backend]
        runs[backend] = _resolve(requirements, tmp_path / f"{backend}.json")
    for backend, run in runs.items():
        output, _ = run.communicate(timeout=600)
        assert run.returncode == 0, f"the {backend} install does not resolve:\n{output[-3000:]}"
        installed = {
            item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads((tmp_path / f"{backend}.json").read_text())["install"]
        }
        mlx_version = _build_backend().MLX_VERSION
        assert installed.get(BACKEND_DISTRIBUTIONS[backend]) == mlx_version, (backend, sorted(installed))
        assert installed.get("mlx") == mlx_version
        others = set(BACKEND_DISTRIBUTIONS.values()) - {BACKEND_DISTRIBUTIONS[backend]}
        assert not others & set(installed), f"the {backend} install also brings {others & set(installed)}"
        if "mlx-lm" in extras_by_backend[backend]:
            assert "mlx-lm" in installed
