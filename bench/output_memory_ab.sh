#!/usr/bin/env bash
# What the fused outputs' memory costs a decode token, on a CUDA machine,
# after bench/run_device.sh has built the package in place.
#
# The fused kernels take their outputs from MLX's stream-ordered device
# pool and write the KV cache in place only over the exact MLX build the
# package compiled against; over any other they take MLX's public
# allocator (unified memory) and copy every cache write. This script builds
# a second copy of the package whose recorded MLX build-id names no real
# build (so the loaded libmlx.so never matches it), then runs
# bench/cache_write.py with each build in turn, alternating, ROUNDS times:
# each run's "patched / mlx-lm" ratio is measured within one process, so
# the two builds are compared through ratios, not absolute times.
#
#   bench/output_memory_ab.sh [ROUNDS] [cache_write.py arguments...]
set -euo pipefail
rounds=${1:-2}
shift || true
arguments=("$@")
[ ${#arguments[@]} -gt 0 ] || arguments=(--model qwen3-1024 --rounds 5 --steps 32)
root=$PWD
copy=$(mktemp -d)/mismatched
mkdir -p "$copy"
cp -r csrc mlx_dualnorm build_ffi.py build_backend.py setup.py pyproject.toml README.md "$copy"/
rm -f "$copy"/mlx_dualnorm/*.so
# A build-id of forty zeros: what a different libmlx.so would record.
sed -i 's|libmlx_build_id(mlx.library_dir / "libmlx.so")|"0" * 40|' "$copy/build_ffi.py"
grep -q '"0" \* 40' "$copy/build_ffi.py" || { echo "could not change the recorded build-id"; exit 1; }
(cd "$copy" && MLX_DUALNORM_BACKEND=cuda13 python3 setup.py -q build_ext --inplace 2>&1 | tail -3)
pool_of() {
  (cd /tmp && PYTHONPATH=$1:$PYTHONPATH python3 -c \
    'import mlx_dualnorm as m; print(m.fused_outputs_in_device_pool())')
}
echo "device pool: as built $(pool_of "$root"), mismatched build $(pool_of "$copy")"
[ "$(pool_of "$root")" = True ] && [ "$(pool_of "$copy")" = False ] \
  || { echo "the two builds do not differ in where the fused outputs come from"; exit 1; }
for round in $(seq "$rounds"); do
  for tree in "$root" "$copy"; do
    label=$([ "$tree" = "$root" ] && echo "device pool" || echo "public allocator")
    echo "--- round $round, $label"
    PYTHONPATH=$tree:$PYTHONPATH python3 "$root/bench/cache_write.py" "${arguments[@]}" \
      | grep -E "^  (mlx-lm|patched|patched-no-write) " | grep -v "per-step"
  done
done
