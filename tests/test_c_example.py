"""The C example, examples/dual_head_norm_example.c, built with the one
line its header comment documents (read from the file, so the documentation
cannot drift from what is tested) and run: against the bundled mlx-c subset
installed as a prefix by scripts/build_subset_mlx_c.sh, and against an
upstream mlx-c prefix named by MLX_DUALNORM_UPSTREAM_MLX_C (see
scripts/build_mlx_c.sh). Only a C compiler builds the example; the subset's
library needs a C++ compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "dual_head_norm_example.c"
# The plain-C composite: every .c file directly in csrc/.
COMPOSITE_SOURCES = sorted((REPO / "csrc").glob("*.c"))
UPSTREAM_VARIABLE = "MLX_DUALNORM_UPSTREAM_MLX_C"
EXAMPLE_BINARY = "dual_head_norm_example"

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler (`cc`) on PATH to build the C example"
)


def documented_build_line() -> str:
    """The one `cc ...` line of the example's header comment."""
    header = EXAMPLE.read_text().split("*/", 1)[0]
    lines = [line.strip().removeprefix("*").strip() for line in header.splitlines()]
    build_lines = [line for line in lines if line.startswith("cc ")]
    assert len(build_lines) == 1, f"expected one `cc` line in the header, found {build_lines}"
    return build_lines[0]


def upstream_prefix() -> Path:
    prefix = os.environ.get(UPSTREAM_VARIABLE)
    if not prefix:
        pytest.skip(
            f"{UPSTREAM_VARIABLE} is not set: point it at an upstream mlx-c prefix "
            "(scripts/build_mlx_c.sh SOURCE PREFIX) to test the example against it"
        )
    return Path(prefix).resolve()


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


def build_and_run_example(mlx_c_prefix: Path, work: Path) -> subprocess.CompletedProcess:
    """Builds the example with the documented line, run as written from a
    folder that looks like the repository root (links to csrc/ and
    examples/), so the binary lands in `work`; then runs it."""
    for folder in ("csrc", "examples"):
        (work / folder).symlink_to(REPO / folder)
    build = subprocess.run(
        ["sh", "-c", documented_build_line()],
        cwd=work,
        env={**os.environ, "MLX_C": str(mlx_c_prefix)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    binary = work / EXAMPLE_BINARY
    if shutil.which("ldd"):
        loaded = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        assert f"libmlxc.so => {mlx_c_prefix}/lib/libmlxc.so" in loaded, loaded
    return subprocess.run(
        [str(binary)], cwd=work, capture_output=True, text=True, timeout=300
    )


def assert_example_succeeded(run: subprocess.CompletedProcess) -> None:
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    lines = run.stdout.splitlines()
    for layout in ("weightless", "weighted"):
        assert f"{layout}: queries and keys bit-identical to mlx_fast_rms_norm" in lines, output
    # Status 2 is MLX_DUALNORM_INVALID_ARGUMENT; then [operation] description.
    assert (
        "rejected: status 2 [apply the compiled MLX dual head norm] query scale weight "
        "has 64 elements but the last dimension of queries is 128"
    ) in lines, output
    assert lines[-1] == "summary: 2 parity checks, 0 mismatched; short weight rejected", output


def test_example_against_bundled_subset(subset_prefix: Path, tmp_path: Path) -> None:
    assert_example_succeeded(build_and_run_example(subset_prefix, tmp_path))


def test_example_against_upstream_mlx_c(tmp_path: Path) -> None:
    assert_example_succeeded(build_and_run_example(upstream_prefix(), tmp_path))


def compiler_warnings(include_flags: list[str]) -> str:
    """What a strict C11 compile of the composite and the example prints."""
    compile_run = subprocess.run(
        ["cc", "-std=c11", "-Wall", "-Wextra", "-pedantic", "-fsyntax-only",
         f"-I{REPO / 'csrc'}", *include_flags, *map(str, COMPOSITE_SOURCES), str(EXAMPLE)],
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


def test_the_readme_documents_the_same_build_line() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert documented_build_line() in readme.splitlines()
