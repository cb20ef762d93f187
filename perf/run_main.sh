#!/usr/bin/env bash
# The main job: install geocomm into .venv and sweep compressed all-reduce
# (fp8 E4M3 block 128, and geofp8 on gradient-like 4096-column matrices)
# against the plain fp32 MPI all-reduce on 2 ranks, 8 B to 128 MiB,
# nccl-tests style, every result checked against its derived error bound.
# Results: perf/results/main_{none,fp8,geofp8}_n2.json.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_venv.sh perf
NRANKS=${NRANKS:-2}
for codec in none fp8 geofp8; do
  "$PY" -m geocomm.launch -n "$NRANKS" --timeout 1800 -- "$PY" perf/all_reduce_perf.py \
    -b 8 -e 128M -f 2 -n 10 -w 3 --codec "$codec" -J "perf/results/main_${codec}_n${NRANKS}.json"
done
