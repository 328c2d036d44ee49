#!/bin/bash
# s25 call 1 ran it as: bash .gpupack/s24-writers-run.sh bench; bash .gpupack/s24-writers-run.sh suite (carry .gpupack; an H100 came)
# Branch s24-ll-writers for the next device calls (staged in s24, never run as built):
#   .gpubin = main 380f58d (GPU code as main 8f4780b), .gpuwr = the branch's first commit (zero-copy dispatch rows in
#   up to 16 parts, a tenth of a fused grid for the receive side), .gpuwr2 = its head (destinations in registers, the review fixes).
# Restage after a rebase: bash scripts/gpu_stage.sh <build> <dir>; tar czf .gpupack/<name>.tgz <dir>. Carry .gpupack.
#   bash .gpupack/s24-writers-run.sh bench   (~90 s: goal shape A/B/C alternating, hidden 128, standard shape)
#   bash .gpupack/s24-writers-run.sh suite   (~300 s: .gpuwr2's whole test_gpu_ll at R = 2, 4, 8)
#   bash .gpupack/s24-writers-run.sh san     (compute-sanitizer on .gpuwr2's test_gpu_ll R = 2, OOB proof first)
# Land the faster passing commit(s) if the suite and the sanitizer pass; quote the bench in the note.
cd "$(dirname "$0")/.."
for t in .gpupack/*.tgz; do tar xzf $t; done
part=${1:-bench}
exec > >(tee -a "$OUT/writers-$part.log") 2>&1
T0=$(date +%s); el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
if [ "$part" = san ]; then SAN_TESTS=test_gpu_ll OUT=$OUT bash scripts/gpu_sanitize.sh .gpuwr2 2; exit $?; fi
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
b() { local d=$1 ch=$2; shift 2; echo "### $d chain=$ch $*"; LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_PDL_CHAIN=$ch timeout 40 .gpubin/epcomm-run "$@" -- $d/epcomm-bench --ops ll "${BARGS[@]}" 2>&1 | grep -E "^dispatch|^combine|rror"; }
if [ "$part" = bench ]; then
  echo "## goal shape (R = 2, 64 tokens, 64 experts, --iters 100), chain 2: main / wr / wr2, 4 rounds"
  BARGS=(--ll-tokens 64 --experts 64 --iters 100)
  for i in 1 2 3 4; do for d in .gpubin .gpuwr .gpuwr2; do b $d 2 -n 2; done; done; el
  echo "## hidden 128 (the protocol alone), chain 2"
  BARGS=(--ll-tokens 64 --experts 64 --hidden 128 --iters 100)
  for i in 1 2; do for d in .gpubin .gpuwr .gpuwr2; do b $d 2 -n 2; done; done; el
  echo "## standard shape (128 tokens, 256 experts, --iters 20), default chain, R = 2, 4, 8"
  BARGS=(--iters 20)
  for R in 2 4 8; do for d in .gpubin .gpuwr .gpuwr2; do b $d 1 -n $R; done; done; el
fi
if [ "$part" = suite ]; then
  for R in 2 4 8; do
    LD_LIBRARY_PATH=.gpuwr2 EPCOMM_GPU_TEST_RANKS=$R timeout 170 .gpuwr2/test_gpu_ll > $OUT/wr2_ll_r$R.log 2>&1
    echo "### wr2 test_gpu_ll R=$R rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/wr2_ll_r$R.log | tail -6; el
  done
fi
