#!/usr/bin/env bash
# Runs mlx_dualnorm's C code under AddressSanitizer (LeakSanitizer
# included) and UndefinedBehaviorSanitizer, in two stages:
#
#   1. C: tests/c/dual_head_norm_c_test.c built with only a C compiler,
#      from the sources (tests/c/test_c_example.py builds it against the
#      installed libmlx_dualnorm instead): the test and csrc/*.c
#      compiled instrumented, linked with -lmlxc from the
#      bundled subset installed instrumented (scripts/build_subset_mlx_c.sh)
#      or, with MLX_C_DIR=PREFIX, from that (upstream, uninstrumented) mlx-c.
#      No Python in the process, so every report is about this code or MLX.
#   2. Python: a copy of the package built instrumented (CFLAGS/LDFLAGS)
#      into a temporary venv, running the reliability tests with libasan
#      preloaded. Python and libmlx are not instrumented and leave plenty
#      of memory unfreed at exit, so leak records are kept only when an
#      allocating frame is in csrc/ (this package's C and C++); memory
#      errors (overflow, use after free, ...) count wherever they are.
#
# Options: --c-only, --python-only, --valgrind (stage 1's test, built
# without sanitizers, under valgrind memcheck as well), --keep (leave the
# work folder). MLX_C_DIR (stage 1 only): an mlx-c prefix to link instead
# of the subset, e.g. upstream's from scripts/build_mlx_c.sh. PYTHON selects the interpreter (default: python3) that has
# mlx[cpu]==0.32.4, cffi, nanobind 3.0.x, numpy, pytest and hypothesis.
# The repository is never modified: the build happens in a copy.
#
# Exit status: 0 when every stage is clean, 1 otherwise.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
RUN_C=1
RUN_PYTHON=1
RUN_VALGRIND=0
KEEP=0
for argument in "$@"; do
  case "$argument" in
    --c-only) RUN_PYTHON=0 ;;
    --python-only) RUN_C=0 ;;
    --valgrind) RUN_VALGRIND=1 ;;
    --keep) KEEP=1 ;;
    *) echo "unknown option $argument" >&2; exit 2 ;;
  esac
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/mlx_dualnorm-sanitizers.XXXXXX")"
cleanup() { if [ "$KEEP" = 0 ]; then rm -rf "$WORK"; else echo "work folder kept: $WORK"; fi; }
trap cleanup EXIT

# libstdc++ is preloaded right after libasan: Python does not link it, and
# ASan's __cxa_throw interceptor must find it at start-up, or the first C++
# exception (MLX throws them for bad input) trips an ASan CHECK.
LIBASAN="$(gcc -print-file-name=libasan.so)"
LIBSTDCXX="$(g++ -print-file-name=libstdc++.so)"
SANITIZE=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g -O1)
# halt_on_error: a memory error ends the process; exitcode=0 keeps leak
# reports (filtered below) from failing child processes the tests start.
ASAN_BASE="detect_leaks=1:halt_on_error=1:exitcode=0:malloc_context_size=40:alloc_dealloc_mismatch=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
STATUS=0

# Leak records (from ASan/LSan logs) allocated through this package's
# sources (a frame in csrc/). $1 selects which: "package" for leaks of the
# package's own code paths, "caller" for handles that a caller (test code)
# took from a raw mlx-c call through cffi (_cffi_f_mlx_*, not the
# composite's _cffi_f_mlx_dualnorm_*) and never freed: the caller's leak.
leaks_in_our_code() {
  local which="$1"; shift
  awk -v which="$which" '
    function flush() {
      if (record != "" && ours && ((which == "caller") == raw)) print record "\n"
      record = ""; ours = 0; raw = 0
    }
    /^(Direct|Indirect) leak of/ { flush(); record = $0; next }
    record != "" && /^ *#[0-9]+ / {
      record = record "\n" $0
      if ($0 ~ /\/csrc\//) ours = 1
      if ($0 ~ /_cffi_f_mlx_/ && $0 !~ /_cffi_f_mlx_dualnorm_/) raw = 1
      next
    }
    record != "" && /^$/ { flush() }
    END { flush() }
  ' "$@"
}

memory_errors() {
  grep -h -A30 "ERROR: AddressSanitizer\|runtime error:" "$@" || true
}

# ---- stage 1: the C test ------------------------------------------------------
build_c_test() {  # $1: output binary, rest: compiler flags (the subset's too)
  local output="$1"; shift
  local prefix="${MLX_C_DIR:-$WORK/mlx-c-$(basename "$output")}"
  if [ -z "${MLX_C_DIR:-}" ]; then
    PYTHON="$PYTHON" CXXFLAGS="$*" "$REPO/scripts/build_subset_mlx_c.sh" "$prefix" > "$WORK/subset-build.log" \
      || { cat "$WORK/subset-build.log"; echo "building the mlx-c subset failed"; exit 1; }
  fi
  # -isystem: an mlx-c's own headers are not this code's to warn about.
  gcc -std=c11 -Wall -Wextra "$@" -I"$REPO/csrc" -I"$REPO/csrc/mlx_dualnorm" -isystem "$prefix/include" \
    "$REPO"/csrc/*.c "$REPO/tests/c/dual_head_norm_c_test.c" \
    -L"$prefix/lib" -lmlxc -Wl,-rpath,"$prefix/lib" -pthread -o "$output"
}

if [ "$RUN_C" = 1 ]; then
  echo "== stage 1: C test under ASan + LSan + UBSan"
  build_c_test "$WORK/c_test_asan" "${SANITIZE[@]}"
  ASAN_OPTIONS="$ASAN_BASE:log_path=$WORK/c-asan" "$WORK/c_test_asan" | tee "$WORK/c-test.out"
  c_status=${PIPESTATUS[0]}
  c_logs=("$WORK"/c-asan.*)
  if [ -e "${c_logs[0]}" ]; then
    errors="$(memory_errors "${c_logs[@]}")"
    leaks="$(leaks_in_our_code package "${c_logs[@]}")"
    all_leaks="$(grep -h "^SUMMARY: AddressSanitizer: .* leaked" "${c_logs[@]}" || true)"
  else
    errors=""; leaks=""; all_leaks=""
  fi
  if [ "$c_status" != 0 ] || ! grep -q ", 0 failed" "$WORK/c-test.out"; then
    echo "C test FAILED (exit status $c_status)"; STATUS=1
  fi
  if [ -n "$errors" ]; then echo "$errors"; echo "C test: memory errors"; STATUS=1; fi
  if [ -n "$leaks" ]; then echo "$leaks"; echo "C test: leaks in csrc/"; STATUS=1; fi
  echo "C test: leaks anywhere: ${all_leaks:-none}"
fi

if [ "$RUN_VALGRIND" = 1 ]; then
  echo "== stage 1b: C test under valgrind memcheck"
  build_c_test "$WORK/c_test_plain" -g -O1
  valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite,indirect \
    --errors-for-leak-kinds=definite --error-exitcode=99 --num-callers=40 \
    --log-file="$WORK/valgrind.log" "$WORK/c_test_plain" | tee "$WORK/c-plain.out" || true
  grep -E "ERROR SUMMARY|definitely lost|indirectly lost|possibly lost" "$WORK/valgrind.log" || true
  if ! grep -q "ERROR SUMMARY: 0 errors" "$WORK/valgrind.log"; then
    grep -B2 -A25 "Invalid\|uninitialised\|definitely lost in" "$WORK/valgrind.log" | head -200
    echo "valgrind: errors"; STATUS=1
  fi
fi

# ---- stage 2: the package under Python ------------------------------------------
if [ "$RUN_PYTHON" = 1 ]; then
  echo "== stage 2: instrumented package, reliability tests, libasan preloaded"
  SOURCE="$WORK/src"
  mkdir -p "$SOURCE"
  (cd "$REPO" && git ls-files --cached --others --exclude-standard -z \
      | grep -zv '\.so$' | xargs -0 tar -cf - ) | tar -xf - -C "$SOURCE"
  # A venv of its own that sees the base interpreter's packages (mlx, cffi,
  # nanobind, pytest, ...) but not its mlx_dualnorm install.
  "$PYTHON" -m venv --without-pip "$WORK/venv"
  BASE_SITE="$(cd / && "$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  VENV_SITE="$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$BASE_SITE" > "$VENV_SITE/base-packages.pth"
  (cd "$SOURCE" && CFLAGS="${SANITIZE[*]}" CXXFLAGS="${SANITIZE[*]}" LDFLAGS="-fsanitize=address,undefined" \
      "$WORK/venv/bin/python" setup.py build_ext --inplace > "$WORK/build.log" 2>&1) \
    || { tail -40 "$WORK/build.log"; echo "instrumented build failed"; exit 1; }
  (cd "$WORK" && PYTHONPATH="$SOURCE" LD_PRELOAD="$LIBASAN:$LIBSTDCXX" ASAN_OPTIONS="detect_leaks=0" \
    "$WORK/venv/bin/python" -c "import mlx_dualnorm; print('instrumented build:', mlx_dualnorm.__file__)")
  (cd "$WORK" && \
    PYTHONPATH="$SOURCE" LD_PRELOAD="$LIBASAN:$LIBSTDCXX" PYTHONMALLOC=malloc \
    ASAN_OPTIONS="$ASAN_BASE:log_path=$WORK/py-asan:detect_odr_violation=0" \
    MLX_DUALNORM_FUZZ_EXAMPLES="${MLX_DUALNORM_FUZZ_EXAMPLES:-100}" \
    "$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider \
      "$SOURCE/tests/core/test_epsilon_contract.py" "$SOURCE/tests/errors/test_faults.py" \
      "$SOURCE/tests/errors/test_lifetime.py" "$SOURCE/tests/errors/test_misuse.py" \
      "$SOURCE/tests/errors/test_bad_input.py" "$SOURCE/tests/errors/test_fuzz_arguments.py" \
      "$SOURCE/tests/c/test_c_api.py" > "$WORK/pytest.out" 2>&1) || true
  tail -15 "$WORK/pytest.out"
  py_logs=("$WORK"/py-asan.*)
  if [ -e "${py_logs[0]}" ]; then
    errors="$(memory_errors "${py_logs[@]}")"
    leaks="$(leaks_in_our_code package "${py_logs[@]}")"
    caller_leaks="$(leaks_in_our_code caller "${py_logs[@]}")"
    echo "ASan logs: ${#py_logs[@]} processes; leak records anywhere (Python, g++, MLX): $(cat "${py_logs[@]}" | grep -c '^Direct leak\|^Indirect leak' || true)"
    if [ -n "$caller_leaks" ]; then
      echo "handles the tests took from raw mlx-c calls and never freed (the tests' leaks, not counted):"
      echo "$caller_leaks" | grep -E "leak of|_cffi_f_" | head -20
    fi
  else
    errors=""; leaks=""
  fi
  summary="$(tail -1 "$WORK/pytest.out")"
  if [[ "$summary" != *passed* || "$summary" =~ [0-9]+\ (failed|error) ]]; then
    echo "pytest under ASan FAILED"; STATUS=1
  fi
  if [ -n "$errors" ]; then echo "$errors" | head -120; echo "Python stage: memory errors"; STATUS=1; fi
  if [ -n "$leaks" ]; then echo "$leaks" | head -200; echo "Python stage: leaks in csrc/"; STATUS=1; fi
fi

if [ "$STATUS" = 0 ]; then echo "SANITIZERS CLEAN"; else echo "SANITIZERS FOUND PROBLEMS"; fi
exit "$STATUS"
