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
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${GEOCOMM_ASAN_VENV:-.venv-asan}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"
FLOAT_CHECKS=-fsanitize=float-cast-overflow,float-divide-by-zero
SAN=(-Csetup-args=-Db_sanitize=address,undefined -Csetup-args=-Db_lundef=false
  "-Csetup-args=-Dc_args=$FLOAT_CHECKS")
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q meson ninja "cffi>=2.1"
# C tests
rm -rf build-asan
PATH="$VENV/bin:$PATH" "$VENV/bin/meson" setup build-asan -Db_sanitize=address,undefined \
  -Db_lundef=false "-Dc_args=$FLOAT_CHECKS" -Dnative_tests=true -Dbuildtype=debugoptimized \
  >/dev/null
PATH="$VENV/bin:$PATH" "$VENV/bin/meson" test -C build-asan --print-errorlogs
# Python tests against the sanitized extension
"$PY" -m pip install -q "torch==2.13.0" ".[test]" "${SAN[@]}" --no-build-isolation 2>/dev/null \
  || "$PY" -m pip install -q "torch==2.13.0" ".[test]" "${SAN[@]}"
PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
LD_PRELOAD="$PRELOAD" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  "$PY" -P -m pytest -q -p no:cacheprovider -m "not mpi" tests/codecs/test_codec_formats.py \
  tests/codecs/test_mx_formats.py tests/codecs/test_stochastic_rounding.py \
  tests/codecs/test_frames.py tests/codecs/test_geometry.py
