#!/usr/bin/env bash
# On a CUDA machine with MLX CUDA unpacked from .gpu/ (and build wheels in .ship/):
# unpack MLX CUDA, install the build's header wheels from .ship/wheels
# (nvidia-cuda-runtime, nvidia-cuda-crt, cmeel-fmt, setuptools; the device
# reaches no registry), build the package in place with the fused mode
# required, then run each argument as a shell command from the project
# root, logging to $OUT/NN.log when $OUT is set.
# Default: bench/gpu_probe.py.
set -uo pipefail
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
if [ -d .ship/wheels ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/build-requirements \
    .ship/wheels/*.whl || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/build-requirements
fi
MLX_DUALNORM_BACKEND=cuda13 python3 setup.py -q build_ext --inplace 2>&1 | tail -5
# The in-place build is imported from the project root, by any script.
export PYTHONPATH=$PWD:$PYTHONPATH
python3 -c 'import mlx_dualnorm as m; print("modes", m.available_modes())' || exit 1
status=0
index=0
for command in "${@:-python3 bench/gpu_probe.py}"; do
  index=$((index + 1))
  log=${OUT:-/tmp}/$(printf '%02d' $index).log
  echo "=== $command"
  bash -c "$command" 2>&1 | tee "$log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
