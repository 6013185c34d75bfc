#!/usr/bin/env bash
# Two builds of the package on one CUDA machine, compared through the
# ratios each measures within its own process: after bench/run_device.sh
# has built this tree in place, builds the tree at OTHER (an unpacked
# earlier revision: `git archive REV | tar -x -C OTHER`) the same way, then
# runs each tree's own bench/cache_write.py in turn, alternating, ROUNDS
# times. Each run prints its paths' ms per token and their ratios to
# mlx-lm's own code in that process; compare the two builds' ratios, not
# their absolute times (the machine drifts between processes).
#
#   bench/builds_ab.sh OTHER [ROUNDS] [cache_write.py arguments...]
set -euo pipefail
other=$(cd "${1:?usage: bench/builds_ab.sh OTHER [ROUNDS] [arguments...]}" && pwd)
rounds=${2:-3}
shift $(($# < 2 ? $# : 2))
arguments=("$@")
[ ${#arguments[@]} -gt 0 ] || arguments=(--model qwen3-1024 --rounds 5 --steps 64)
root=$PWD
rm -f "$other"/mlx_dualnorm/*.so
(cd "$other" && MLX_DUALNORM_BACKEND=cuda13 python3 setup.py -q build_ext --inplace 2>&1 | tail -3)
for round in $(seq "$rounds"); do
  for tree in "$root" "$other"; do
    label=$([ "$tree" = "$root" ] && echo "this tree" || echo "$(basename "$other")")
    echo "--- round $round, $label"
    (cd "$tree" && PYTHONPATH=$tree:${PYTHONPATH#"$root":} python3 bench/cache_write.py \
      "${arguments[@]}" | grep -E "^  (mlx-lm|patched) ")
  done
done
