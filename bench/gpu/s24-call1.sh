#!/bin/bash
# s24 call 1 (sections in this order: a2, b2, b3, b1, b, a, d, c): (a) the goal-shape LL bench again, main 380f58d (.gpubin) against branch s21-ll-late-eb (.gpuexp), default
# grid and 34 blocks, chain 1 and 2, three rounds, then branch s24-ll-prefetch (.gpupf): EPCOMM_GPU_LL_ZD_PREFETCH / _PARTS / _RSIDE and blocks (the s23 note asks for a repeat before dropping the branch); (b) the
# probe build (146b37a, the branch's GPU code) at hidden 128 and 7168: where the protocol's time goes; (c) main's
# test_gpu_ll at R = 4 and 8 on one host, the whole LL suite across 2 virtual hosts at R = 4, then HT and LL at 2 x 4
# while time is left. Ranks under MPS. Logs in $OUT.
cd "$(dirname "$0")/.."
T0=$(date +%s)
for t in .gpupack/*.tgz; do tar xzf $t; done
exec > >(tee -a "$OUT/s24-call1.log") 2>&1
echo "## staged: $(cat .gpupack/STAGED)"
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.max.sm --format=csv
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
export NCCL_NVLS_ENABLE=0
el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
b() { local d=$1 eb=$2 arr=$3 ch=$4 B=$5; shift 5; echo "### $d late_eb=$eb arrivals=$arr chain=$ch blocks=$B prefetch=${PF:-} parts=${PARTS:-8} rside=${RSIDE:-0} $*"; LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_ZD_PREFETCH=${PF:-0} EPCOMM_GPU_LL_ZD_PARTS=${PARTS:-8} EPCOMM_GPU_LL_ZD_RSIDE=${RSIDE:-0} EPCOMM_GPU_LL_BLOCKS=$B EPCOMM_GPU_LL_ZD_LATE_EB=$eb EPCOMM_GPU_LL_ZD_ARRIVALS=$arr EPCOMM_GPU_LL_PDL_CHAIN=$ch timeout 40 .gpubin/epcomm-run "$@" -- $d/epcomm-bench --ops ll "${BARGS[@]}" 2>&1 | grep -E "^dispatch zero-copy  |^combine zero-copy|rror"; }
BARGS=(--ll-tokens 64 --experts 64 --iters 100)
echo "## (a2) branch s24-ll-prefetch: prefetch x parts cap x receive-side blocks x blocks, chain 2, goal shape, two rounds"
for i in 1 2; do for B in 0 64; do for PARTS in 8 16; do for RSIDE in 0 4; do for PF in 0 1; do PF=$PF PARTS=$PARTS RSIDE=$RSIDE b .gpupf 0 0 2 $B -n 2; done; done; done; done; b .gpubin 0 0 2 0 -n 2; done
el
echo "## (b2) branch s24-ll-prefetch (prefetch on): test_gpu_ll R = 2"
LD_LIBRARY_PATH=.gpupf EPCOMM_GPU_TEST_RANKS=2 timeout 100 .gpupf/test_gpu_ll > $OUT/pf_ll_r2.log 2>&1; echo "### pf_ll_r2 rc $?"
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests? from .* ran" "$OUT/pf_ll_r2.log" | tail -8
echo "## (b3) the same branch, parts 16 and 4 receive-side blocks: BitExact, ZeroCopy*, GraphReplay*, ChainedLaunches at R = 2"
LD_LIBRARY_PATH=.gpupf EPCOMM_GPU_LL_ZD_PARTS=16 EPCOMM_GPU_LL_ZD_RSIDE=4 EPCOMM_GPU_TEST_RANKS=2 timeout 80 .gpupf/test_gpu_ll --gtest_filter='*BitExactAgainst*:*ZeroCopy*:*GraphReplay*:*Chained*' > $OUT/pf_ll_r2_p16.log 2>&1; echo "### pf_ll_r2_p16 rc $?"
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests? from .* ran" "$OUT/pf_ll_r2_p16.log" | tail -8
el
echo "## (b) probe of branch s24-ll-prefetch (.gpupfprobe) as main (prefetch 0, parts 8), chain 2 default blocks: hidden 128"
LD_LIBRARY_PATH=.gpupfprobe EPCOMM_GPU_LL_ZD_PREFETCH=0 EPCOMM_GPU_LL_PDL_CHAIN=2 timeout 40 .gpubin/epcomm-run -n 2 -- .gpupfprobe/epcomm-bench --ops ll --ll-tokens 64 --experts 64 --hidden 128 --iters 50 2>&1 | grep -E "^PROBE dispatch zero-copy r|^dispatch zero-copy  |^combine zero-copy  " | head -12
echo "## (b1) probe of branch s24-ll-prefetch (.gpupfprobe), hidden 7168, chain 2 default blocks: parts 8 / 16, prefetch 0 / 1"
for a in "8 0 0" "16 0 0" "16 4 0" "16 0 1"; do set -- $a; echo "### parts=$1 rside=$2 prefetch=$3"
LD_LIBRARY_PATH=.gpupfprobe EPCOMM_GPU_LL_ZD_PARTS=$1 EPCOMM_GPU_LL_ZD_RSIDE=$2 EPCOMM_GPU_LL_ZD_PREFETCH=$3 EPCOMM_GPU_LL_PDL_CHAIN=2 timeout 40 .gpubin/epcomm-run -n 2 -- .gpupfprobe/epcomm-bench --ops ll --ll-tokens 64 --experts 64 --iters 50 2>&1 | grep -E "^PROBE dispatch zero-copy r|^dispatch zero-copy  " | head -9
done
el
echo "## (a) goal shape --ll-tokens 64 --experts 64 --iters 100, R=2"
BARGS=(--ll-tokens 64 --experts 64 --iters 100)
for i in 1 2; do for B in 0 34; do for ch in 2 1; do b .gpubin 0 0 $ch $B -n 2; b .gpuexp 1 0 $ch $B -n 2; b .gpuexp 1 1 $ch $B -n 2; done; done; done
el
export LD_LIBRARY_PATH=.gpubin
echo "## (d) HT, issue 11's shapes (4096 tokens, hidden 7168, top-8, 256 experts, bf16): R = 8 at 16 and 14 SMs, R = 2 and 4 at 24"
for a in "8 16 0" "8 14 0" "8 16 2" "8 16 3" "2 24 0" "4 24 0"; do set -- $a; echo "### R=$1 sms=$2 warps_per_peer=$3"; EPCOMM_GPU_WARPS_PER_PEER=$3 timeout 60 .gpubin/epcomm-run -n $1 -- .gpubin/epcomm-bench --ops ht --iters 20 --sms $2 2>&1 | grep -E "^HT |rror|^epcomm-bench"; done
el
run() {  # name, ranks, hosts, timeout, binary, [gtest args]
  local name=$1 R=$2 H=$3 T=$4 bin=$5; shift 5
  local left=$(( 575 - ($(date +%s) - T0) )); [ $left -lt 30 ] && { echo "### $name: skipped, $left s left"; return; }
  [ $T -gt $left ] && T=$left
  EPCOMM_GPU_TEST_RANKS=$R EPCOMM_GPU_TEST_HOSTS=$H timeout $T .gpubin/$bin "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "### $name: $bin R=$R hosts=$H rc=$rc"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests? from .* ran" "$OUT/$name.log" | tail -8
  el
}
echo "## (e) branch s24-ll-prefetch, standard shape (128 tokens, 256 experts) --iters 20, R = 2, 4, 8: prefetch 0 / 1, main"
BARGS=(--iters 20)
for R in 2 4 8; do PF=0 b .gpupf 0 0 1 0 -n $R; PF=1 b .gpupf 0 0 1 0 -n $R; b .gpubin 0 0 1 0 -n $R; done
el
runpf() {  # name, ranks, timeout: the branch's whole test_gpu_ll with parts 16, prefetch on
  local name=$1 R=$2 T=$3
  local left=$(( 575 - ($(date +%s) - T0) )); [ $left -lt 30 ] && { echo "### $name: skipped, $left s left"; return; }
  [ $T -gt $left ] && T=$left
  LD_LIBRARY_PATH=.gpupf EPCOMM_GPU_LL_ZD_PARTS=16 EPCOMM_GPU_TEST_RANKS=$R timeout $T .gpupf/test_gpu_ll > "$OUT/$name.log" 2>&1; local rc=$?
  echo "### $name: branch test_gpu_ll parts 16 R=$R rc=$rc"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests? from .* ran" "$OUT/$name.log" | tail -8
  el
}
runpf pf_ll_r4 4 110
runpf pf_ll_r8 8 140
run ll_r4_h2 4 2 150 test_gpu_ll
run ll_r8_h2 8 2 120 test_gpu_ll
