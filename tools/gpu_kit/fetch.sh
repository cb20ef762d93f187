#!/usr/bin/env bash
# Make the offline GPU kit (tools/gpu_kit/README.md) on a machine with a package
# index, for a GPU machine without one:
#
#   bash tools/gpu_kit/fetch.sh --python 3.12 --out KIT [--numpy] [--platform TAG]...
#
# KIT/wheels: the pinned wheels of tools/gpu_kit/kit.py (CPython --python, x86-64
# manylinux), downloaded with pip download --no-deps --only-binary=:all:;
# KIT/geocomm-src.tar.gz: `git archive HEAD` of this repository (commit it first:
# uncommitted changes are not in it, and the manifest says so); KIT/run.sh and
# KIT/kit.py; KIT/manifest.json: what is in it, with sizes and sha256. kit.py
# verify checks that every requirement of every wheel is in the kit or on the GPU
# machine already (numpy, torch, CuPy) and that the kit stays under 64 MiB.
# --numpy adds a numpy wheel, for a machine that has none (one with its own numpy
# keeps it: its torch and CuPy were built against it). --platform replaces the
# default platform tags. PYTHON (default python3) runs pip here.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-python3}
TARGET="" OUTDIR="" NUMPY="" PLATFORMS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) TARGET=$2; shift 2 ;;
    --out) OUTDIR=$2; shift 2 ;;
    --numpy) NUMPY=--numpy; shift ;;
    --platform) PLATFORMS+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "fetch.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$TARGET" ] && [ -n "$OUTDIR" ] || { echo "fetch.sh: --python and --out are required" >&2; exit 2; }
[[ "$TARGET" =~ ^3\.[0-9]+$ ]] || { echo "fetch.sh: --python takes a version like 3.12" >&2; exit 2; }
if [ ${#PLATFORMS[@]} -eq 0 ]; then
  mapfile -t PLATFORMS < <("$PYTHON" -c "import sys; sys.path.insert(0, '$HERE'); import kit; print('\n'.join(kit.PLATFORMS))")
fi
SECONDS=0
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -rf "$OUTDIR/wheels" "$OUTDIR/manifest.json"
mkdir -p "$OUTDIR/wheels"

mapfile -t PINS < <("$PYTHON" "$HERE/kit.py" pins --python "$TARGET" $NUMPY)
echo "gpu_kit: downloading ${#PINS[@]} wheels for CPython $TARGET (${PLATFORMS[*]})"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" \
  --implementation cp "${platform_args[@]}" -d "$OUTDIR/wheels" "${PINS[@]}"

commit=$(git -C "$ROOT" rev-parse HEAD)
dirty=()
if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ]; then
  echo "gpu_kit: warning: uncommitted changes in $ROOT are not in the kit (it holds $commit)" >&2
  dirty=(--dirty)
fi
git -C "$ROOT" archive --format=tar.gz --prefix=geocomm/ -o "$OUTDIR/geocomm-src.tar.gz" HEAD
cp "$HERE/run.sh" "$HERE/kit.py" "$HERE/README.md" "$OUTDIR/"

"$PYTHON" "$HERE/kit.py" verify "$OUTDIR" --python "$TARGET" $NUMPY \
  --source geocomm-src.tar.gz --commit "$commit" "${dirty[@]}"
echo "gpu_kit: $OUTDIR made in $SECONDS s; copy it to the GPU machine and run there:"
echo "  bash $(basename "$OUTDIR")/run.sh --out results"
