#!/usr/bin/env bash
# Proves every mlx-lm release the package claims, one at a time:
# tests/mlx_lm_integration/test_mlx_lm_releases.py with that release first
# on the path (installed with --no-deps --target: the rest is the
# environment's own), so each family it has decodes bit-identically
# patched and unpatched with the default, rotating and batched caches, and
# what patch() engages is that release's row of docs/mlx-lm.md's table.
#
#   scripts/test_mlx_lm_releases.sh PYTHON FOLDER
#
# PYTHON: an environment with the package, its test extra and mlx-lm
# (the installed mlx-lm is the last release proven); FOLDER: where the
# other releases are installed (kept: a second run reuses them).
set -euo pipefail
PYTHON=${1:?usage: $0 PYTHON FOLDER}
FOLDER=${2:?usage: $0 PYTHON FOLDER}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [[ $PYTHON == */* ]]; then  # absolute: the tests run from FOLDER
  PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"
fi
RELEASES=(0.30.7 0.31.3 0.32.0 0.32.1)
TESTS="$ROOT/tests/mlx_lm_integration/test_mlx_lm_releases.py"
mkdir -p "$FOLDER"
FOLDER=$(cd "$FOLDER" && pwd)

run() {  # RELEASE [PATH]: the release test file with PATH first on the path
  local release=$1 path=${2:-}
  echo "--- mlx-lm $release"
  (cd "$FOLDER" && MLX_DUALNORM_MLX_LM_RELEASE="$release" PYTHONPATH="$path" \
    "$PYTHON" -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning "$TESTS")
}

for release in "${RELEASES[@]}"; do
  target="$FOLDER/mlx-lm-$release"
  if [ ! -d "$target/mlx_lm" ]; then
    "$PYTHON" -m pip install -q --no-deps --target "$target" "mlx-lm==$release"
  fi
  run "$release" "$target"
done
run "$("$PYTHON" -c 'import mlx_lm; print(mlx_lm.__version__)')"
