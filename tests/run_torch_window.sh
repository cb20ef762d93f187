#!/usr/bin/env bash
# The torch adapters on both ends of the supported torch window
# (geocomm/adapters/torch/support.py): torch 2.9.1 and 2.15.0, each in a venv of its
# own (.venv-torch-VERSION) with geocomm and its test extras.
#
#   bash tests/run_torch_window.sh prepare   # make the venvs (downloads: run it early)
#   bash tests/run_torch_window.sh test      # the DDP hook, FSDP2, backend, Lightning,
#                                            # checkpoint and example suites on each
#
# tests/run.sh runs "prepare" in the background while its own suites run, then "test".
# PyPI's torch wheels for Linux are CUDA builds (several GB with their NVIDIA
# libraries); they run on the CPU. The machine's pip configuration may cap torch
# below the window's newest release, so these venvs read no pip configuration.
# GEOCOMM_TORCH_WINDOW overrides the versions (space-separated).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VERSIONS=${GEOCOMM_TORCH_WINDOW:-"2.9.1 2.15.0"}
SUITES=(tests/adapters tests/comm/test_torchdist_device.py)
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
# The venvs are installed without bytecode (pip --no-compile: compiling all of torch
# would take the cores the main suites run on), so their modules must be allowed to
# cache theirs when first imported: with PYTHONDONTWRITEBYTECODE set, as some CI images
# do, every process compiled torch's and Lightning's sources again (12.7 s an import of
# torch and Lightning against 5.8 s, and the window's suites took twice as long).
unset PYTHONDONTWRITEBYTECODE

prepare() {
  for v in $VERSIONS; do
    venv=.venv-torch-$v
    echo "== torch $v: $venv"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --no-compile "torch==$v" ".[test,frameworks]"
    # the import also caches torch's and Lightning's bytecode before the tests start
    "$venv/bin/python" -c "import torch, lightning; assert torch.__version__.startswith('$v'), torch.__version__"
  done
}

run_tests() {
  for v in $VERSIONS; do
    py=.venv-torch-$v/bin/python
    echo "== torch adapters on torch $v"
    # each example once, under torchrun: under mpirun it bootstraps as the MPI suites
    # below do (init_distributed_from_mpi), and the main suite runs both launchers
    "$py" -P -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 -m "not mpi" \
      -k "not mpirun" "${SUITES[@]}"
    "$py" -m geocomm.launch -n 2 --timeout 1200 -- \
      "$py" -P -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider -m mpi "${SUITES[@]}"
  done
}

case "${1:-}" in
  prepare) prepare ;;
  test) run_tests ;;
  *) echo "usage: bash tests/run_torch_window.sh prepare|test" >&2; exit 2 ;;
esac
