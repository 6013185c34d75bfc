"""The package as an index shows it and an sdist carries it: the metadata
the build writes (PEP 639's license expression and license file, the
classifiers, the authors), a build that warns of nothing about them, a
setuptools bound that is the one the build runs with, and an sdist whose
documents' links all resolve inside it.

The build hooks run for real, in a subprocess, on a copy of the source tree
(a build writes egg-info and its record beside the sources), with this
environment's setuptools: the ``test`` extra installs the one the build
requires.
"""

from __future__ import annotations

import email
import email.message
import pathlib
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not (ROOT / "build_backend.py").is_file(), reason="not a source tree"
)

# The CPython minor versions MLX 0.32.4 ships wheels for: the package's
# classifiers and its wheels cover each (docs/release.md).
MLX_PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14", "3.15")
# What a source tree holds that is no part of the sources.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.o",
    ".pytest_cache", ".hypothesis", "bench-results", "_native.c", "_built_against.py",
)


def _tomllib():
    return pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")


def _pyproject() -> dict:
    return _tomllib().loads((ROOT / "pyproject.toml").read_text())


def _requirement(requirements: list[str], name: str) -> str:
    (found,) = [r for r in requirements if re.match(rf"{name}\b(?![-\w])", r)]
    return found


def _build_hook(tree: pathlib.Path, hook: str, out: pathlib.Path) -> tuple[str, str]:
    """Runs build_backend.HOOK(out) in TREE, warnings shown; (its result, stderr)."""
    process = subprocess.run(
        [sys.executable, "-W", "always", "-c",
         f"import sys, build_backend; print(build_backend.{hook}(sys.argv[1]))", str(out)],
        cwd=tree, capture_output=True, text=True, timeout=600,
    )
    assert process.returncode == 0, f"{hook} failed:\n{process.stdout[-3000:]}\n{process.stderr[-3000:]}"
    return process.stdout.strip().splitlines()[-1], process.stderr


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    requires = _pyproject()["build-system"]["requires"]
    setuptools_range = _requirement(requires, "setuptools")
    import packaging.requirements as packaging_requirements  # a dependency of the test tools
    import setuptools

    assert packaging_requirements.Requirement(setuptools_range).specifier.contains(
        setuptools.__version__
    ), (f"setuptools {setuptools.__version__} is installed where the build requires "
        f"{setuptools_range}: pip install -e '.[test]' installs it")
    pytest.importorskip("nanobind", reason="setup.py describes the nanobind bridge")
    tree = tmp_path_factory.mktemp("source") / "mlx_dualnorm"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCES)
    return tree


@pytest.fixture(scope="module")
def wheel_metadata(source_copy: pathlib.Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("metadata")
    dist_info, warnings = _build_hook(source_copy, "prepare_metadata_for_build_wheel", out)
    metadata = email.message_from_bytes((out / dist_info / "METADATA").read_bytes())
    return metadata, out / dist_info, warnings


@pytest.fixture(scope="module")
def sdist(source_copy: pathlib.Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("sdist")
    name, warnings = _build_hook(source_copy, "build_sdist", out)
    with tarfile.open(out / name) as archive:
        top = name.removesuffix(".tar.gz")
        members = {member.name.removeprefix(f"{top}/") for member in archive.getmembers()}
        pkg_info = archive.extractfile(f"{top}/PKG-INFO").read()
        documents = {
            member.name.removeprefix(f"{top}/"): archive.extractfile(member).read().decode()
            for member in archive.getmembers()
            if member.isfile() and member.name.endswith(".md")
        }
    return members, email.message_from_bytes(pkg_info), documents, warnings


def _check_license_and_classifiers(metadata: email.message.Message) -> None:
    assert tuple(map(int, metadata["Metadata-Version"].split("."))) >= (2, 4), metadata["Metadata-Version"]
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    # PEP 639: the expression replaces the License field and license classifiers.
    assert metadata["License"] is None
    classifiers = metadata.get_all("Classifier") or []
    assert not [c for c in classifiers if c.startswith("License ::")], classifiers
    versions = {c.rsplit(" :: ", 1)[1] for c in classifiers
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    assert versions == set(MLX_PYTHONS), sorted(versions)
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert "Typing :: Typed" in classifiers
    assert metadata["Author"] == "the mlx_dualnorm authors"
    assert metadata["Requires-Python"] == f">={MLX_PYTHONS[0]}"


def test_the_wheel_metadata_declares_the_license_expression_classifiers_and_authors(wheel_metadata):
    metadata, dist_info, _ = wheel_metadata
    _check_license_and_classifiers(metadata)
    assert (dist_info / "licenses" / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()


def test_the_build_warns_of_nothing_about_the_license_or_deprecations(wheel_metadata, sdist):
    for hook_warnings in (wheel_metadata[2], sdist[3]):
        warning_lines = [line for line in hook_warnings.splitlines()
                         if "Warning" in line or "deprecat" in line.lower()]
        assert not [line for line in warning_lines if "license" in line.lower()], hook_warnings[-3000:]
        assert "SetuptoolsDeprecationWarning" not in hook_warnings, hook_warnings[-3000:]


def test_the_setuptools_bound_is_the_one_the_test_extra_installs() -> None:
    """The build's setuptools has an upper bound (a release past it is
    untested), and the tests above run that very range."""
    project = _pyproject()
    build_range = _requirement(project["build-system"]["requires"], "setuptools")
    assert re.search(r"<\s*\d+", build_range), f"{build_range}: no upper bound"
    assert re.search(r">=\s*77", build_range), f"{build_range}: PEP 639 needs setuptools 77"
    test_extra = project["project"]["optional-dependencies"]["test"]
    assert _requirement(test_extra, "setuptools") == build_range
    assert _requirement(test_extra, "nanobind") == _requirement(
        project["build-system"]["requires"], "nanobind"
    )


LINK_TARGET = re.compile(r"\]\(([^)\s]+)")


def _relative_links(text: str) -> list[str]:
    """A Markdown document's link targets outside code blocks that are
    paths (not URLs, not bare anchors), anchors dropped."""
    targets, in_code = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            for target in LINK_TARGET.findall(line):
                path = target.partition("#")[0]
                if path and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", path):
                    targets.append(path)
    return targets


def test_the_sdist_holds_every_file_its_documents_link(sdist) -> None:
    members, _, documents, _ = sdist
    assert "README.md" in documents and "docs/release.md" in documents
    folders = {str(pathlib.PurePosixPath(member).parent) for member in members}
    unresolved = []
    for document, text in documents.items():
        for target in _relative_links(text):
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(document), target))
            if resolved not in members and resolved not in folders:
                unresolved.append(f"{document} -> {target}")
    assert not unresolved, "links to files the sdist does not hold:\n" + "\n".join(unresolved)


def test_the_sdist_holds_what_release_md_says_it_does(sdist, source_copy: pathlib.Path) -> None:
    """docs/release.md: the scripts (``scripts/``, every file), the whole
    test suite, the documents (``docs/``, ``bench/``), README.md and
    LICENSE: every file of those folders of the sources it was built from."""
    members = sdist[0]
    for folder in ("scripts", "tests", "docs", "bench"):
        for path in (source_copy / folder).rglob("*"):
            if path.is_file():
                relative = str(path.relative_to(source_copy))
                assert relative in members, f"the sdist lacks {relative}"
    assert {"README.md", "LICENSE", "pyproject.toml", "setup.py", "build_backend.py"} <= members


def test_the_sdist_metadata_is_the_wheel_s(sdist) -> None:
    _check_license_and_classifiers(sdist[1])


def test_the_stable_abi_floor_is_the_oldest_python_the_package_supports() -> None:
    """The wheel is tagged for the stable ABI of the oldest CPython the
    package supports, so that one wheel installs on each later one; the
    bridge's nanobind runtime comes from the package that ships it per
    CPython."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mlx_dualnorm_build_ffi", ROOT / "build_ffi.py")
    assert spec and spec.loader
    build_ffi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_ffi)
    major, minor = (int(part) for part in MLX_PYTHONS[0].split("."))
    assert build_ffi.STABLE_ABI_FLOOR == (major, minor)
    assert build_ffi.WHEEL_PYTHON_TAG == f"cp{major}{minor}"
    assert int(build_ffi.PY_LIMITED_API, 16) == (major << 24) | (minor << 16)
    project = _pyproject()["project"]
    assert project["requires-python"] == f">={MLX_PYTHONS[0]}"
    backend = _requirement(project["dependencies"], build_ffi.NANOBIND_BACKEND_DISTRIBUTION)
    assert re.fullmatch(r"nanobind-backend>=1\.0,<2", backend), backend
