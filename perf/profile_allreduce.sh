#!/usr/bin/env bash
# Where the time of a compressed all-reduce goes: Linux perf samples every
# process of a 2-rank all_reduce_perf run (ranks, MPI, kernel TCP and tc work)
# on an emulated link, and the top symbols go to a markdown table.
#
#   bash perf/profile_allreduce.sh [rate] [codec] [size]     # defaults: 10gbit fp8 64M
#
# Needs root (emulated link) and `perf`. Setup (input generation, warm-up)
# is sampled too, but the timed loop of 60 calls dominates.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-10gbit}
CODEC=${2:-fp8}
SIZE=${3:-64M}
PY=${PYTHON:-python}
OUT=perf/results/profile_${CODEC}_${RATE}_n2
command -v perf >/dev/null || { echo "profile_allreduce: needs linux perf" >&2; exit 2; }
DATA=$(mktemp /tmp/geocomm-perf.XXXXXX)
trap 'rm -f "$DATA" "$DATA.txt" "$OUT.timing"' EXIT
CMD=("$PY" perf/emulated_link.py --rate "$RATE" -n 2 -- "$PY" perf/all_reduce_perf.py
     -b "$SIZE" -e "$SIZE" -n 60 -w 3 -c 0 --codec "$CODEC")
perf record -q -F 999 -g -o "$DATA" -- "${CMD[@]}" | grep -E '^ +[0-9]|^# yardstick' > "$OUT.timing"
{
  echo "# Profile: ${CODEC} all-reduce of ${SIZE}, 2 ranks, emulated ${RATE} link"
  echo
  echo "Command: \`bash perf/profile_allreduce.sh ${RATE} ${CODEC} ${SIZE}\` (perf record -F 999"
  echo "over every process of \`${CMD[*]}\`). all_reduce_perf's yardstick and result lines:"
  echo
  echo '```'
  cat "$OUT.timing"
  echo '```'
  echo
  echo "| share of samples | object | symbol |"
  echo "| ---: | --- | --- |"
  perf report -i "$DATA" --no-children --sort dso,sym --stdio -g none 2>/dev/null > "$DATA.txt"
  # awk reads all of it (no head: a closed pipe would fail the script under pipefail)
  awk '/^ +[0-9]/ && n < 25 {n++; pct=$1; dso=$2; $1=""; $2=""; $3=""; sub(/^ +/, "");
       printf "| %s | %s | %s |\n", pct, dso, $0}' "$DATA.txt"
} > "$OUT.md"
echo "wrote $OUT.md"
