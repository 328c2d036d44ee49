#!/usr/bin/env bash
# Copies what scripts/gpu_run.sh needs from a CUDA build (default build-gpu/) into one folder (default
# .gpubin/, ignored by git), with the CUDA runtime it was linked against, so it can travel to a GPU machine.
set -euo pipefail
BUILD=${1:-build-gpu}
DST=${2:-.gpubin}
mkdir -p "$DST"
cp "$BUILD/tests/gpu/test_gpu_ht" "$BUILD/tests/gpu/test_gpu_ll" "$BUILD/bench/epcomm-bench" "$BUILD/src/launcher/epcomm-run" "$DST/"
cp -P "$BUILD"/src/libepcomm.so "$BUILD"/src/libepcomm.so.0 "$BUILD"/src/libepcomm.so.0.1.0 "$DST/"
cudart=$(ldd "$BUILD/tests/gpu/test_gpu_ht" | awk '/libcudart/ {print $3}')
[ -n "$cudart" ] && cp -L "$cudart" "$DST/"
du -sh "$DST"
