#!/usr/bin/env bash
# GPU HT sweep: epcomm-bench over SM budgets and token counts, ranks under a private MPS daemon, every row
# appended to one CSV ($OUT/bench_sweep.csv); draw it with scripts/plot_bench.py. ITERS (3) and WARMUP (1): the
# bench's --iters and --warmup (the plain HT combine reads x in place from about its third call on: implicit
# registration, src/engine/gpu/registry_implicit.cc).
#   scripts/bench_sweep.sh [BIN_DIR] [ranks] [sms] [tokens]     e.g. .gpubin 2,4,8 8,16,24,32 1024,4096
set -uo pipefail
BIN=${1:-.gpubin}
IFS=, read -ra RS <<< "${2:-2,4,8}"
IFS=, read -ra SMS <<< "${3:-8,16,24,32}"
IFS=, read -ra TOKS <<< "${4:-1024,4096}"
OUT=${OUT:-/tmp/epcomm-sweep}
mkdir -p "$OUT"
CSV=$OUT/bench_sweep.csv
export LD_LIBRARY_PATH="$BIN:${LD_LIBRARY_PATH:-}"
if [ "${NO_MPS:-0}" != 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mps-pipe.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mps-log.XXXX)
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
for r in "${RS[@]}"; do
  for s in "${SMS[@]}"; do
    for t in "${TOKS[@]}"; do
      timeout 120 "$BIN/epcomm-run" -n "$r" -- "$BIN/epcomm-bench" --ops ht --sms "$s" --ht-tokens "$t" \
        --iters "${ITERS:-3}" --warmup "${WARMUP:-1}" --csv "$CSV" 2>&1 | grep -E "^HT" | sed "s/^/R=$r sms=$s: /"
    done
  done
done
echo "rows in $CSV: $(($(wc -l < "$CSV") - 1))"
