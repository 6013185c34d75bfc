#!/usr/bin/env bash
# Builds mlx_dualnorm against an installed UPSTREAM mlx-c instead of the
# bundled subset, and runs the whole test suite on that build:
#
#   scripts/test_against_mlx_c.sh PREFIX [PYTEST ARGUMENTS...]
#
# PREFIX is an mlx-c install (include/mlx/c/mlx.h, lib/libmlxc.so), e.g.
# from scripts/build_mlx_c.sh. The repository is never modified: its files
# (tracked, and untracked ones git does not ignore) are copied to a
# throwaway folder, built there in place with MLX_C_DIR=PREFIX (see
# build_ffi.py), and tested there with that copy first on PYTHONPATH.
# PYTHON selects the interpreter (default: python3) that has mlx[cpu],
# cffi, numpy, pytest and hypothesis; nanobind 3.0.x is installed into the
# throwaway folder when that interpreter lacks it. KEEP=1 keeps the folder.
#
# Every test runs, the ones marked slow included (-m ""; a -m among the
# PYTEST ARGUMENTS, which come later, decides instead).
#
# Exit status: pytest's (0 when every test passes), 1 when the build fails.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 MLX_C_PREFIX [PYTEST ARGUMENTS...]" >&2
  exit 2
fi
PREFIX="$(realpath "$1")"
shift
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [[ ! -f "$PREFIX/include/mlx/c/mlx.h" || ! -e "$PREFIX/lib/libmlxc.so" ]]; then
  echo "error: $PREFIX is not an mlx-c install (include/mlx/c/mlx.h, lib/libmlxc.so);" \
       "build one with scripts/build_mlx_c.sh" >&2
  exit 2
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/mlx_dualnorm-upstream-mlx-c.XXXXXX")"
if [[ "${KEEP:-0}" == 1 ]]; then
  echo "test_against_mlx_c: work folder kept at $WORK"
else
  trap 'rm -rf "$WORK"' EXIT
fi
TREE="$WORK/tree"
mkdir "$TREE"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard) |
  (cd "$REPO" && xargs -0 cp --parents -t "$TREE")

# The build needs nanobind (the interop module); an interpreter without it
# gets it in the throwaway folder, not in its own environment.
PYTHON_PATH="$TREE"
if ! (cd / && "$PYTHON" -c 'import nanobind') 2>/dev/null; then
  "$PYTHON" -m pip install --quiet --target "$WORK/build-deps" "nanobind>=3.0.1,<3.1"
  PYTHON_PATH="$TREE:$WORK/build-deps"
fi

echo "test_against_mlx_c: building against the mlx-c at $PREFIX"
if ! (cd "$TREE" && MLX_C_DIR="$PREFIX" PYTHONPATH="$PYTHON_PATH" \
        "$PYTHON" setup.py build_ext --inplace >"$WORK/build.log" 2>&1); then
  tail -n 40 "$WORK/build.log" >&2
  echo "test_against_mlx_c: the build against $PREFIX failed (log above)" >&2
  exit 1
fi

# The bundled subset must not have slipped in: the C API has to come from
# libmlxc, undefined in the module itself.
NATIVE="$(ls "$TREE"/mlx_dualnorm/_native*.so)"
if ! ldd "$NATIVE" | grep -q "libmlxc.so => $PREFIX/lib/libmlxc.so"; then
  echo "error: $NATIVE does not load $PREFIX/lib/libmlxc.so" >&2
  exit 1
fi
if nm -D --defined-only "$NATIVE" | grep -qw mlx_array_eval; then
  echo "error: $NATIVE defines mlx_array_eval itself (bundled subset built in)" >&2
  exit 1
fi
IMPORTED="$(cd "$TREE/tests" && PYTHONPATH="$PYTHON_PATH" "$PYTHON" -c \
  'import mlx_dualnorm, os; print(os.path.dirname(mlx_dualnorm.__file__))')"
if [[ "$IMPORTED" != "$TREE/mlx_dualnorm" ]]; then
  echo "error: the tests would import mlx_dualnorm from $IMPORTED, not the copy" >&2
  exit 1
fi

echo "test_against_mlx_c: running the test suite on that build"
cd "$TREE"
PYTHONPATH="$PYTHON_PATH" "$PYTHON" -m pytest -p no:cacheprovider -m "" tests "$@"
