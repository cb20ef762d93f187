#!/usr/bin/env bash
# The main job: install geocomm into .venv and sweep compressed all-reduce
# (fp8 E4M3 block 128, nvfp4, mxfp8 and geofp8 on gradient-like 4096-column
# matrices) against the plain fp32 MPI all-reduce on 2 ranks, 1 KiB to 64 MiB,
# nccl-tests style, every result checked against its derived error bound:
# over shared memory and, where this machine can make a network namespace
# (root), over emulated 10 Gbit/s and 1 Gbit/s links (perf/main_job.py).
# Ends with one summary table per link in perf/out/ (not tracked): main_n2.{md,json},
# plots main_{link}_n2.png, reports main_{link}_{codec}_n2.json; its last line
# says where. --publish writes them to perf/results/ instead (the committed
# results, refreshed on purpose). Arguments go to perf/main_job.py (e.g. --links shm).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_venv.sh perf
NRANKS=${NRANKS:-2}
"$PY" perf/main_job.py -n "$NRANKS" "$@"
