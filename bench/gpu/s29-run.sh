#!/bin/bash
# s29's device calls, on builds made here and carried (carry [".gpupack"]):
#   bash scripts/gpu_stage.sh build-gpu .gpupack/main && strip --strip-debug .gpupack/main/*
#   bash bench/gpu/s29-run.sh quick [DIR]   (~560 s) common.sh's quick on DIR (default .gpupack/main)
cd "$(dirname "$0")/../.."
part=${1:-quick}; D=${2:-.gpupack/main}
source bench/gpu/common.sh
gpu_log s29 $part
[ -x $D/epcomm-bench ] || { echo "### $D has no staged build"; exit 1; }
if [ "$part" = quick ]; then quick $D; fi
