# Sourced by the bench/gpu session scripts: one definition of what each of them needs on the device machine.
#   gpu_build DIR        a CUDA build of this tree in build-gpu/ (kept between calls while the machine is warm),
#                        staged into DIR with scripts/gpu_stage.sh (test_gpu_ht, test_gpu_ll, epcomm-bench,
#                        epcomm-run, libepcomm); nothing is done if DIR already holds them
#   mps_start            a private CUDA MPS daemon for the rank processes, stopped when the script exits
#   b DIR CHAIN RANKS [VAR=VALUE ...]
#                        the LL rows of DIR's epcomm-bench (arguments in the array BARGS) at EPCOMM_GPU_LL_PDL_CHAIN
#   el                   seconds since the script started
#   goal DIR ROUNDS      issue 9's goal shape (R = 2, 64 tokens, 64 experts, hidden 7168, chain 2, --iters 100),
#                        ROUNDS times (leaves BARGS set to it)
#   xhost DIR N [VAR=VALUE ...]
#                        DIR's bench across XH (2) virtual hosts at -n N (OPS, XT), rows with xhost/raw
#   threads              top's view of every thread, once a second until killed: CPU% summed by thread name
#   gpu_log NAME PART    output also into $OUT/NAME-PART.log (OUT defaults to /tmp/NAME), and the GPU's name
#   pb DIR [--ARG VALUE ...] [VAR=VALUE ...]
#                        DIR's proxy_bench at R = 2 over net/socket (2048 MiB a peer, 2 writers, 5 reps, then the
#                        --ARGs), its result line
#   suite1 T R H TIMEOUT $D's test_gpu_T at R ranks over H virtual hosts (under MPS), log in $OUT, its verdict
#   trace OPS [VAR=VALUE ...]
#                        $D's bench at -n 4 across 2 hosts with the proxy's trace (EPCOMM_GPU_PROXY_TRACE=1, TITERS
#                        iterations, 20 by default): its rows, and per rank the last lines of its occupancy (outbox in
#                        use, near-full share, inbox backlog), busy shares, net calls and payloads in flight
#   san_ll DIR           compute-sanitizer on DIR's test_gpu_ll at R = 2 (the proof, memcheck, synccheck, then
#                        racecheck within the call's 560 s)
#   suite DIR [LABEL]    DIR's test_gpu_ll at R = 8 and at R = 4 across 2 virtual hosts, test_gpu_ht at R = 2, each
#                        while the call's 585 s last
#   quick DIR            everything still open on one GPU, for a call that may be the session's only one: issue 9's
#                        goal shape 3 rounds, the LL standard shape at R = 2, 4, 8, issue 11's HT shapes (R = 8 at
#                        14 and 16 SMs, R = 2 and 4 at 24), the GPU engine across 2 virtual hosts (HT and LL,
#                        xhost/raw), then bench/net/host_xhost_diag.sh if under 330 s have passed
#   unpack_packs         untars each carried .gpupack/NAME.tar.xz whose folder is missing
#   left                 seconds left of the call's BUDGET (560 by default) since the script started
#   N2 BIG NOSLEEP R0    the settings the A/B parts name: 2 helper threads per connection, 4 MiB proxy messages
#                        with 32 MiB rings, a proxy thread that never sleeps, no readiness poll
T0=${T0:-$(date +%s)}
unpack_packs() { for x in .gpupack/*.tar.xz; do [ -f "$x" ] && [ ! -d "${x%.tar.xz}" ] && tar xJf "$x" -C .gpupack; done; }
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
N2="EPCOMM_NET_NTHREADS=2"
BIG="EPCOMM_GPU_PROXY_MSG_BYTES=4194304 EPCOMM_GPU_PROXY_RING_BYTES=33554432"
NOSLEEP="EPCOMM_BACKOFF_YIELDS=100000000"
R0="EPCOMM_NET_READINESS=0"
el() { echo "## elapsed $(( $(date +%s) - T0 )) s"; }
gpu_build() {
  local d=$1
  [ -x "$d/test_gpu_ll" ] && [ -x "$d/epcomm-bench" ] && return 0
  if [ ! -f build-gpu/build.ninja ]; then meson setup build-gpu -Dcuda=enabled > "$OUT/gpu_build.log" 2>&1 || return 1; fi
  ninja -C build-gpu tests/gpu/test_gpu_ll tests/gpu/test_gpu_ht bench/epcomm-bench src/launcher/epcomm-run \
    >> "$OUT/gpu_build.log" 2>&1 || { tail -20 "$OUT/gpu_build.log"; return 1; }
  bash scripts/gpu_stage.sh build-gpu "$d" > /dev/null
}
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
  nvidia-cuda-mps-control -d && echo "MPS started"
  trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
}
b() { local d=$1 ch=$2 n=$3; shift 3; echo "### $d chain=$ch -n $n $*"
  env "$@" LD_LIBRARY_PATH=$d EPCOMM_GPU_LL_PDL_CHAIN=$ch timeout 40 $d/epcomm-run -n $n -- $d/epcomm-bench --ops ll "${BARGS[@]}" 2>&1 \
    | grep -E "^dispatch|^combine|rror"; }
goal() { echo "## (a) goal shape, chain 2, $2 rounds"; BARGS=(--ll-tokens 64 --experts 64 --iters 100)
  for i in $(seq $2); do b $1 2 2; done; el; }
# xhost DIR N [VAR=VALUE ...]: DIR's epcomm-bench across XH (default 2) virtual hosts at -n N over net/socket, the
# rows with xhost/raw (OPS: the bench's --ops, default ht,ll; XT: the timeout, default 150 s; BENCH_ARGS: more)
# A run that prints no row shows its exit status and last lines (a timeout is rc 124).
xhost() { local d=$1 n=$2 log=${OUT:-/tmp}/xhost.log; shift 2; echo "### $d -n $n --hosts ${XH:-2} $BENCH_ARGS $*"
  env "$@" LD_LIBRARY_PATH=$d EPCOMM_NET=socket timeout ${XT:-150} $d/epcomm-run -n $n --hosts ${XH:-2} -- \
    $d/epcomm-bench --ops ${OPS:-ht,ll} --iters 10 $BENCH_ARGS > $log 2>&1; local rc=$?
  grep -E "^(HT|LL|dispatch|combine|net raw)|rror" $log || { echo "rc $rc, no rows; its last lines:"; tail -8 $log; }; }
# threads: one line per sample where the threads used more than half a core: CPU% summed by thread name (threads,
# busiest one's %): the proxy, the socket helpers (epcomm-sock), the ranks' own (epcomm-bench), MPS
threads() { top -b -H -d 1 -w 200 | awk '/^top -/{ if (n) out(); n++; delete s; delete c; delete m; next }
  $1 ~ /^[0-9]+$/ && $9+0 > 0 { k=$12; s[k]+=$9; c[k]++; if ($9+0 > m[k]) m[k]=$9+0 }
  function out(  t, k, l) { t=0; l=""; for (k in s) { t+=s[k]; l=l sprintf(" %s %.0f (%d, max %.0f)", k, s[k], c[k], m[k]) }
    if (n > 1 && t > 50) print "t=" n " total " t l; fflush() }'; }
pb() { local d=$1; shift; local a=(); while [ "${1#--}" != "${1:-}" ]; do a+=("$1" "$2"); shift 2; done
  echo -n "pb [$d ${a[*]} $*]: "
  env "$@" EPCOMM_NET=socket LD_LIBRARY_PATH=$d timeout 60 $d/proxy_bench --ranks 2 --mb 2048 --writers 2 --reps 5 \
    "${a[@]}" 2>&1 | grep -E "^2 +[0-9.]+ |rror" | tail -1; }
suite1() { local t=$1 r=$2 h=$3 to=$4
  LD_LIBRARY_PATH=$D EPCOMM_GPU_TEST_RANKS=$r EPCOMM_GPU_TEST_HOSTS=$h timeout $to $D/test_gpu_$t > $OUT/${t}_r${r}_h$h.log 2>&1
  echo "### test_gpu_$t R=$r hosts=$h rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/${t}_r${r}_h$h.log | tail -6; el; }
trace() { local ops=$1; shift; echo "### trace $ops $*"
  env "$@" EPCOMM_GPU_PROXY_TRACE=1 LD_LIBRARY_PATH=$D EPCOMM_NET=socket timeout 60 $D/epcomm-run -n 4 --hosts 2 -- \
    $D/epcomm-bench --ops $ops --iters ${TITERS:-20} > $OUT/trace_$ops.log 2>&1; echo "rc $?"
  grep -E "^(HT|LL|dispatch|combine|net raw)|rror" $OUT/trace_$ops.log
  for r in 0 1 2 3; do grep -E "proxy rank $r( ->|:| net calls:| payloads in flight:)" $OUT/trace_$ops.log | grep -v "busy 0%" | tail -6 \
    | sed -E 's/ring at [0-9]+ \(stamp there [0-9]+, type [0-9]+\), //'; done; }
gpu_log() {
  OUT=${OUT:-/tmp/$1}; mkdir -p "$OUT"
  exec > >(tee -a "$OUT/$1-$2.log") 2>&1
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
}
san_ll() {
  SAN_TESTS=test_gpu_ll SAN_TOOLS="memcheck synccheck" OUT=$OUT bash scripts/gpu_sanitize.sh $1 2; echo "### rc $?"; el
  SAN_TESTS=test_gpu_ll SAN_TOOLS=racecheck FILTER='-*Sanitizer*:Fp8Conversion*' SAN_TIMEOUT=$(( 560 - ($(date +%s) - T0) )) \
    OUT=$OUT bash scripts/gpu_sanitize.sh $1 2; echo "### racecheck rc $?"; el
}
suite() {
  local d=$1 label=${2:+$2 }
  for run in "ll 8 1 250" "ll 4 2 150" "ht 2 1 120"; do set -- $run
    left=$(( 585 - ($(date +%s) - T0) )); [ $left -lt 40 ] && { echo "### $run skipped ($left s left)"; continue; }
    LD_LIBRARY_PATH=$d EPCOMM_GPU_TEST_RANKS=$2 EPCOMM_GPU_TEST_HOSTS=$3 timeout $(( $4 < left ? $4 : left )) \
      $d/test_gpu_$1 > $OUT/$1_r$2_h$3.log 2>&1
    echo "### ${label}test_gpu_$1 R=$2 hosts=$3 rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" $OUT/$1_r$2_h$3.log | tail -6; el
  done
}
quick() {
  local d=$1
  ( mps_start
    goal $d 3
    echo "## (b) LL standard shape (128 tokens, 256 experts, --iters 20), R = 2, 4, 8"; BARGS=(--iters 20)
    for R in 2 4 8; do b $d 1 $R; done; el
    echo "## (d) HT at issue 11's shapes (4096 tokens, hidden 7168, top-8, 256 experts)"
    for a in "8 14" "8 16" "2 24" "4 24"; do set -- $a; echo "### HT R=$1 sms=$2"
      LD_LIBRARY_PATH=$d timeout 60 $d/epcomm-run -n $1 -- $d/epcomm-bench --ops ht --iters 20 --sms $2 2>&1 \
        | grep -E "^HT |rror|^epcomm-bench"; done; el
    echo "## (x) GPU engine across 2 virtual hosts (net socket): HT and LL rows with xhost/raw"
    for n in 4 8; do XT=120 xhost $d $n; done; el )
  [ $(( $(date +%s) - T0 )) -lt 330 ] && OUT=$OUT bash bench/net/host_xhost_diag.sh; el
}
