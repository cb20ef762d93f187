#!/usr/bin/env bash
# Memory safety of the native core: build it with AddressSanitizer and
# UndefinedBehaviorSanitizer (meson's b_sanitize option), run the C unit
# tests, then the single-process Python tests against the sanitized
# extension (python itself is not instrumented, so the runtime is preloaded).
# gcc's -fsanitize=undefined leaves out float-cast-overflow (a float to
# integer conversion of a NaN, an infinity or a value out of range: undefined
# in C, INT_MIN on x86, saturated on a GPU) and float-divide-by-zero (IEEE
# defines it, but 0 / 0 is a NaN whose sign differs between x86 and GPUs), so
# they are added: the core does neither.
#
# Only geocomm is built again: the sanitized package goes into its own folder
# (build-asan/python), first on PYTHONPATH, and everything else (torch, the
# test tools) comes from the test environment, .venv (GEOCOMM_VENV), which
# tools/setup_venv.sh makes if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GEOCOMM_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  source tools/setup_venv.sh test
fi
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"   # meson, ninja and cffi-gen-src
# the sanitizers, for the C tests' build and the Python package's alike
FLOAT_CHECKS=-fsanitize=float-cast-overflow,float-divide-by-zero
SANITIZE=(-Db_sanitize=address,undefined -Db_lundef=false "-Dc_args=$FLOAT_CHECKS")
# the build tools, beside the test environment's cffi (pyproject's build-system)
"$PY" -m pip install -q "meson-python>=0.16" "meson>=1.3" ninja
# one sanitized build (build-asan) serves both: the package, then the C tests in it
rm -rf build-asan
PACKAGE="$PWD/build-asan/python"
"$PY" -m pip install -q --no-deps --no-build-isolation --target "$PACKAGE" . \
  -Cbuild-dir=build-asan "${SANITIZE[@]/#/-Csetup-args=}" -Csetup-args=-Dnative_tests=true
meson test -C build-asan --print-errorlogs
# Python tests against the sanitized extension
export PYTHONPATH="$PACKAGE"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# the tests must see the sanitized core, not the one installed in the environment
"$PY" -P -c "import geocomm.kernels.native as n, sys
sys.exit(not (n.available and n.__file__.startswith('$PACKAGE/')))" \
  || { echo "run_sanitized.sh: the sanitized core in $PACKAGE does not load" >&2; exit 1; }
"$PY" -P -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 -m "not mpi" \
  tests/codecs/test_codec_formats.py \
  tests/codecs/test_mx_formats.py tests/codecs/test_stochastic_rounding.py \
  tests/codecs/test_frames.py tests/codecs/test_geometry.py
