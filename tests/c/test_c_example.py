"""libmlx_dualnorm as a C program uses it: installed with the one command
docs/c-library.md documents, then the example (examples/) built with
find_package and with pkg-config, and the C test (tests/c/) built with
find_package, each run. The commands are read from the files that document
them, so the documentation cannot drift from what is tested.

Against the bundled mlx-c subset installed as a prefix by
scripts/build_subset_mlx_c.sh, and against an upstream mlx-c prefix named by
MLX_DUALNORM_UPSTREAM_MLX_C (see scripts/build_mlx_c.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "dual_head_norm_example.c"
LIBRARY_DOC = REPO / "docs" / "c-library.md"
C_TEST_PROJECT = REPO / "tests" / "c" / "CMakeLists.txt"
# The plain-C composite: every .c file directly in csrc/.
COMPOSITE_SOURCES = sorted((REPO / "csrc").glob("*.c"))
UPSTREAM_VARIABLE = "MLX_DUALNORM_UPSTREAM_MLX_C"
# What the commands run in: the repository's folders, linked into a fresh
# folder so their build folders land there, not in the repository.
LINKED_FROM_REPO = ("csrc", "examples", "tests", "pyproject.toml")

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler (`cc`) on PATH to build the C example"
)


def needs_cmake() -> None:
    if shutil.which("cmake") is None:
        pytest.skip("no `cmake` on PATH to build libmlx_dualnorm")


def lines_starting(text: str, start: str) -> list[str]:
    """The lines starting with `start`, read past a C (` * `) or CMake
    (`# `) comment's leader."""
    stripped = (
        line.strip().removeprefix("*").removeprefix("#").strip() for line in text.splitlines()
    )
    return [line for line in stripped if line.startswith(start)]


def the_line(path: Path, start: str, header_only: bool = False) -> str:
    """The one line of `path` that starts with `start` (in a C file's
    header comment only, with `header_only`)."""
    text = path.read_text(encoding="utf-8")
    if header_only:
        text = text.split("*/", 1)[0]
    found = lines_starting(text, start)
    assert len(found) == 1, f"expected one line starting {start!r} in {path}, found {found}"
    return found[0]


def install_command() -> str:
    return the_line(LIBRARY_DOC, "cmake -S csrc ")


def example_cmake_command() -> str:
    return the_line(EXAMPLE, "cmake -S examples ", header_only=True)


def example_pkg_config_command() -> str:
    return the_line(EXAMPLE, "cc ", header_only=True)


def c_test_cmake_command() -> str:
    return the_line(C_TEST_PROJECT, "cmake -S tests/c ")


def upstream_prefix() -> Path:
    prefix = os.environ.get(UPSTREAM_VARIABLE)
    if not prefix:
        pytest.skip(
            f"{UPSTREAM_VARIABLE} is not set: point it at an upstream mlx-c prefix "
            "(scripts/build_mlx_c.sh SOURCE PREFIX) to test against it"
        )
    return Path(prefix).resolve()


def run_documented(command: str, work: Path, env: dict[str, str], timeout: int = 600) -> None:
    """Runs a documented command as written, from `work` (the repository's
    folders linked in), with MLX_C and PREFIX set as the docs name them."""
    for name in LINKED_FROM_REPO:
        if not (work / name).exists():
            (work / name).symlink_to(REPO / name)
    run = subprocess.run(
        ["sh", "-c", command],
        cwd=work,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"


@pytest.fixture(scope="session")
def subset_prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled subset installed to a fresh prefix, once per session."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (`g++`) to build the bundled mlx-c subset")
    prefix = tmp_path_factory.mktemp("mlx-c-subset")
    build = subprocess.run(
        ["bash", str(REPO / "scripts" / "build_subset_mlx_c.sh"), str(prefix)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return prefix


class InstalledLibrary:
    """libmlx_dualnorm installed to `prefix` over the mlx-c at `mlx_c`."""

    def __init__(self, mlx_c: Path, work: Path) -> None:
        self.mlx_c = mlx_c
        self.work = work
        self.prefix = work / "prefix"
        run_documented(install_command(), work, self.env)

    @property
    def env(self) -> dict[str, str]:
        return {"MLX_C": str(self.mlx_c), "PREFIX": str(self.prefix)}


@pytest.fixture(scope="session")
def library_over_subset(subset_prefix: Path, tmp_path_factory: pytest.TempPathFactory):
    needs_cmake()
    return InstalledLibrary(subset_prefix, tmp_path_factory.mktemp("library-over-subset"))


@pytest.fixture(scope="session")
def library_over_upstream(tmp_path_factory: pytest.TempPathFactory):
    needs_cmake()
    return InstalledLibrary(upstream_prefix(), tmp_path_factory.mktemp("library-over-upstream"))


@pytest.fixture(params=["library_over_subset", "library_over_upstream"])
def library(request: pytest.FixtureRequest) -> InstalledLibrary:
    return request.getfixturevalue(request.param)


def assert_loads_the_installed_libraries(binary: Path, library: InstalledLibrary) -> None:
    if shutil.which("ldd") is None:
        return
    loaded = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    assert f"=> {library.prefix}/lib/libmlx_dualnorm.so" in loaded, loaded
    assert f"libmlxc.so => {library.mlx_c}/lib/libmlxc.so" in loaded, loaded


def run_binary(binary: Path, library: InstalledLibrary) -> subprocess.CompletedProcess:
    assert_loads_the_installed_libraries(binary, library)
    return subprocess.run([str(binary)], cwd=binary.parent, capture_output=True, text=True,
                          timeout=300)


def assert_example_succeeded(run: subprocess.CompletedProcess) -> None:
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    lines = run.stdout.splitlines()
    for layout in ("weightless", "weighted"):
        assert f"{layout}: queries and keys bit-identical to mlx_fast_rms_norm" in lines, output
    # Status 2 is MLX_DUALNORM_INVALID_ARGUMENT; then [operation] description.
    assert (
        "rejected: status 2 [dual_head_norm] query_weight "
        "has 64 elements but the last dimension of queries is 128"
    ) in lines, output
    assert lines[-1] == "summary: 2 parity checks, 0 mismatched; short weight rejected", output


def test_the_library_exports_only_its_api(library_over_subset: InstalledLibrary) -> None:
    if shutil.which("nm") is None:
        pytest.skip("no `nm` to list the library's symbols")
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(library_over_subset.prefix / "lib" / "libmlx_dualnorm.so")],
        capture_output=True, text=True, check=True,
    ).stdout.split("\n")
    names = [line.split()[-1] for line in symbols if line.strip()]
    assert "mlx_dualnorm_compiled_dual_head_norm_new" in names, names
    assert "mlx_dualnorm_dual_head_norm_rope_new" in names, names
    assert [name for name in names if not name.startswith("mlx_dualnorm_")] == []


def test_the_library_installs_only_its_public_headers(
    library_over_subset: InstalledLibrary,
) -> None:
    """The public API is the folder csrc/mlx_dualnorm/ (as mlx-c's is
    mlx/c/): exactly its headers are installed, none of csrc/private/."""
    installed = sorted(
        path.name for path in (library_over_subset.prefix / "include" / "mlx_dualnorm").iterdir()
    )
    public = sorted(path.name for path in (REPO / "csrc" / "mlx_dualnorm").glob("*.h"))
    private = {path.name for path in (REPO / "csrc" / "private").glob("*.h")}
    assert "dual_head_norm.h" in public
    assert installed == public
    assert private.isdisjoint(installed)


def test_example_built_with_find_package(library: InstalledLibrary) -> None:
    run_documented(example_cmake_command(), library.work, library.env)
    binary = library.work / "build" / "example" / "dual_head_norm_example"
    assert_example_succeeded(run_binary(binary, library))


def test_example_built_with_pkg_config(library: InstalledLibrary, tmp_path: Path) -> None:
    if shutil.which("pkg-config") is None:
        pytest.skip("no `pkg-config` on PATH")
    run_documented(example_pkg_config_command(), tmp_path, library.env)
    assert_example_succeeded(run_binary(tmp_path / "dual_head_norm_example", library))


def test_c_test_built_with_find_package(library: InstalledLibrary) -> None:
    run_documented(c_test_cmake_command(), library.work, library.env)
    run = run_binary(library.work / "build" / "c-test" / "dual_head_norm_c_test", library)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert ", 0 failed" in run.stdout, output


def compiler_warnings(include_flags: list[str]) -> str:
    """What a strict C11 compile of the composite and the example prints
    (the example includes the public headers as an installed program does,
    from their folder: pkg-config's Cflags)."""
    compile_run = subprocess.run(
        ["cc", "-std=c11", "-Wall", "-Wextra", "-pedantic", "-fsyntax-only",
         f"-I{REPO / 'csrc'}", f"-I{REPO / 'csrc' / 'mlx_dualnorm'}", *include_flags,
         *map(str, COMPOSITE_SOURCES), str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert compile_run.returncode == 0, compile_run.stderr
    return compile_run.stderr


def test_c_sources_compile_without_warnings_against_subset_headers() -> None:
    assert compiler_warnings([f"-I{REPO / 'csrc' / 'mlxc'}"]) == ""


def test_c_sources_compile_without_warnings_against_upstream_headers() -> None:
    # -isystem: upstream's own headers are not this project's to warn about.
    assert compiler_warnings(["-isystem", str(upstream_prefix() / "include")]) == ""


def test_the_library_doc_shows_the_commands_tested() -> None:
    doc_lines = LIBRARY_DOC.read_text(encoding="utf-8").splitlines()
    assert example_cmake_command() in doc_lines
    assert example_pkg_config_command() in doc_lines


def test_the_readme_documents_the_install_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert install_command() in readme.splitlines()
