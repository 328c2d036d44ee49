#!/bin/bash
# s25 call 4: main's LL code as landed (c0e393a; its GPU code is .gpuwr2's) at #9's goal shape on whatever card
# comes, a sweep of its zero-copy dispatch knobs there (EPCOMM_GPU_LL_BLOCKS x _ZD_PARTS x _ZD_RSIDE, chain 2),
# and a probe build of main (-DEPCOMM_LL_PROBE, .gpuprobe25) at hidden 7168 and 128: where the 14.7 us now go.
cd "$(dirname "$0")/.."
for t in .gpupack/main.tgz .gpupack/wr2.tgz .gpupack/probe25.tgz; do tar xzf $t; done
exec > >(tee -a "$OUT/call4.log") 2>&1
T0=$(date +%s); el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
G='^dispatch zero-copy  |^dispatch zero-copy fp8|^combine zero-copy|rror'
b() { echo "### $*"; env "$@" EPCOMM_GPU_LL_PDL_CHAIN=2 LD_LIBRARY_PATH=.gpuwr2 timeout 40 .gpubin/epcomm-run -n 2 -- .gpuwr2/epcomm-bench --ops ll --ll-tokens 64 --experts 64 --iters 100 2>&1 | grep -E "$G"; }
echo "## (a) goal shape, main as landed (.gpuwr2) and main before (.gpubin), 3 rounds"
for i in 1 2 3; do b X=landed; echo "### before"; LD_LIBRARY_PATH=.gpubin EPCOMM_GPU_LL_PDL_CHAIN=2 timeout 40 .gpubin/epcomm-run -n 2 -- .gpubin/epcomm-bench --ops ll --ll-tokens 64 --experts 64 --iters 100 2>&1 | grep -E "$G"; done; el
echo "## (b) knobs (blocks x parts x rside), goal shape, chain 2"
for B in 34 40 44; do for P in 16 32; do for S in -1 2 6; do
  b EPCOMM_GPU_LL_BLOCKS=$B EPCOMM_GPU_LL_ZD_PARTS=$P EPCOMM_GPU_LL_ZD_RSIDE=$S
done; done; done; el
echo "## (c) probe (main as landed, -DEPCOMM_LL_PROBE), goal shape hidden 7168 then 128, chain 2"
for H in 7168 128; do
  echo "### probe hidden $H"
  LD_LIBRARY_PATH=.gpuprobe25 EPCOMM_GPU_LL_PDL_CHAIN=2 timeout 40 .gpubin/epcomm-run -n 2 -- .gpuprobe25/epcomm-bench --ops ll --ll-tokens 64 --experts 64 --hidden $H --iters 50 2>&1 | grep -E "^PROBE dispatch zero-copy r|^dispatch zero-copy  " | head -12
done; el
