"""docs/design.md's file table ("File by file") matches the tree: every
entry of its `file` column names files that exist, and every source file of
the package (mlx_dualnorm/) and of the C side (csrc/, the bundled mlx-c
subset excepted: the table names its folder) is named by some row.

An entry is a path (`csrc/fused/output_memory.cpp`), a folder (`tools/`:
every file below it), a glob (`output_memory.*`, `csrc/private/*.h`) or a
brace list (`dual_head_norm.{h,c}`). Entries starting `mlx_dualnorm/` or
`csrc/` are from the repository's root; the others from the row's layer
folder (LAYER_FOLDERS). Only the `file` column counts: the descriptions
name files in passing.

On failure the message lists the rows to add (files no row names, each in
a row of its layer) and the entries to remove or fix (naming nothing), so
the table is refreshed in one edit.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
TABLE_TITLE = "File by file"
TABLE_HEADER = "| layer | file | what it holds |"

# Where a row's entries that are not from the root are read from.
LAYER_FOLDERS = {
    "facade": "mlx_dualnorm",
    "commands": "mlx_dualnorm",
    "bridge": "csrc/interop",
    "C core": "csrc",
    "plug-in": "csrc/fused",
    "mlx-c": "csrc/mlxc",
    "build": ".",
}
ROOT_PREFIXES = ("mlx_dualnorm/", "csrc/")

# The files the table must cover: what the package and the C side are made
# of, as a build or a reader meets them.
PACKAGE_SUFFIXES = {".py", ".pyi"}
PACKAGE_FILES = {"py.typed"}
CSRC_SUFFIXES = {".c", ".h", ".cpp", ".cuh", ".in", ".map"}
CSRC_FILES = {"CMakeLists.txt"}
# Written by each build (build_ffi.py; git-ignored): not the tree's.
GENERATED = {"mlx_dualnorm/_built_against.py"}
SKIPPED_FOLDERS = {"__pycache__"}


def table_rows() -> list[tuple[str, list[str]]]:
    """(layer, entries of the file column) of each row of the table."""
    lines = DESIGN.read_text(encoding="utf-8").splitlines()
    title_at = next(index for index, line in enumerate(lines) if TABLE_TITLE in line)
    header_at = lines.index(TABLE_HEADER, title_at)
    rows = []
    for line in lines[header_at + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"a row of the file table without three cells: {line}"
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def expanded(pattern: str) -> list[str]:
    """A brace list as its alternatives: `a.{h,c}` is `a.h` and `a.c`."""
    braces = re.search(r"\{([^{}]+)\}", pattern)
    if braces is None:
        return [pattern]
    return [
        name
        for alternative in braces.group(1).split(",")
        for name in expanded(pattern[: braces.start()] + alternative + pattern[braces.end():])
    ]


def files_named(layer: str, entry: str) -> set[str]:
    """The files (root-relative, POSIX) an entry of a `layer` row names."""
    if entry.startswith(ROOT_PREFIXES):
        base = ROOT
    else:
        assert layer in LAYER_FOLDERS, f"a row of an unknown layer {layer!r}: add it to LAYER_FOLDERS"
        base = ROOT / LAYER_FOLDERS[layer]
    named = set()
    for pattern in expanded(entry):
        for path in base.glob(pattern.rstrip("/")):
            paths = path.rglob("*") if path.is_dir() else [path]
            named.update(
                found.relative_to(ROOT).as_posix()
                for found in paths
                if found.is_file() and not SKIPPED_FOLDERS & set(found.parts)
            )
    return named


def tree_sources() -> set[str]:
    """The files the table must cover, root-relative."""
    package = {
        path
        for path in (ROOT / "mlx_dualnorm").rglob("*")
        if path.suffix in PACKAGE_SUFFIXES or path.name in PACKAGE_FILES
    }
    csrc = {
        path
        for path in (ROOT / "csrc").rglob("*")
        if (path.suffix in CSRC_SUFFIXES or path.name in CSRC_FILES)
        and (ROOT / "csrc" / "mlxc") not in path.parents
    }
    return {
        path.relative_to(ROOT).as_posix()
        for path in package | csrc
        if path.is_file() and not SKIPPED_FOLDERS & set(path.parts)
    } - GENERATED


def layer_of(source: str) -> str:
    """The layer whose folder holds `source` most closely."""
    return max(
        (layer for layer, folder in LAYER_FOLDERS.items()
         if folder == "." or source.startswith(folder + "/")),
        key=lambda layer: len(LAYER_FOLDERS[layer]),
    )


@pytest.fixture(scope="module")
def rows() -> list[tuple[str, list[str]]]:
    if not DESIGN.exists():
        pytest.skip("docs/design.md is not in this copy of the tree (an unpacked sdist)")
    return table_rows()


def test_the_table_has_rows_for_every_layer(rows):
    assert {layer for layer, _ in rows} == set(LAYER_FOLDERS)


def test_every_entry_names_files_that_exist(rows):
    to_remove = [
        f"| {layer} | `{entry}` | (names nothing)"
        for layer, entries in rows
        for entry in entries
        if not files_named(layer, entry)
    ]
    assert not to_remove, "docs/design.md's file table: remove or fix\n" + "\n".join(to_remove)


def test_every_source_file_is_in_the_table(rows):
    named = set().union(*(files_named(layer, entry) for layer, entries in rows for entry in entries))
    missing = sorted(tree_sources() - named)
    to_add = [f"| {layer_of(source)} | `{source}` | ... |" for source in missing]
    assert not to_add, "docs/design.md's file table: add rows for\n" + "\n".join(to_add)


def test_an_entry_is_read_as_the_files_it_names():
    """The reading above, on entries whose files are known: a path, a brace
    list, a glob from a layer's folder, a folder, and one naming nothing."""
    assert files_named("C core", "csrc/mlx_dualnorm/dual_head_norm.h") == {
        "csrc/mlx_dualnorm/dual_head_norm.h"
    }
    assert files_named("C core", "dual_head_norm.{c,h}") == {"csrc/dual_head_norm.c"}
    assert "csrc/fused/output_memory.cpp" in files_named("plug-in", "output_memory.*")
    assert "csrc/cmake/mlx_dualnorm.map" in files_named("build", "csrc/cmake/")
    assert files_named("facade", "no_such_module.py") == set()
    assert layer_of("csrc/fused/output_memory.h") == "plug-in"
    assert layer_of("mlx_dualnorm/commands/cli.py") == "facade"
