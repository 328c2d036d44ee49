#!/bin/bash
# Where the host engine's time goes across virtual hosts on a many-core machine (issue 12's xhost/raw: 0.09-0.12
# on the GPU machine's 16 cores at R = 4 / 8, about half of the 2-core VM's, with 68 % of the machine idle in s12).
# CPU only; builds build-host/ (no CUDA) from this tree unless it is there. On the device machine:
#   OUT=$OUT bash bench/net/host_xhost_diag.sh        (~4 min on 16 cores; SHORT=1: (a) default and 1 channel only,
#                                                     no (b))
# It prints, for -n 4 and -n 8 over 2 virtual hosts:
#   (a) the operations with the default channels, then EPCOMM_HOST_CHANNELS=1, 2, 4, EPCOMM_QUEUE_BYTES=4 MiB and
#       EPCOMM_BACKOFF_YIELDS=100000 (waits yield instead of sleeping);
#   (b) the same ranks on one host (no net at all), for the engine's own speed there, also through the queues
#       (EPCOMM_HOST_CMA=0) with 1 and 4 channels: s12 measured 7.3 ms for HT dispatch that way on 16 cores against
#       ~10 ms on 2, so the queues alone barely use the cores;
#   (c) per-thread CPU of every rank during a long HT run (from /proc): which threads work and which wait;
#   (d) with perf on the machine, a flat profile of that run.
# (Before s29's 5a5162e the channel runs measured one channel: the API turned num_channels 0 into 1. With
# channels working, 4 per rank at -n 4 changed nothing on the 16 cores: bench/results/h100-s29.log, call 2.)
# Reading it: channels that change nothing, with the channel threads idle in (c), mean one serial step per rank
# (the bridge's one connection and thread per peer, or the forwarder's whole-message store-and-forward) bounds it;
# no-sleep much faster means waiters oversleep (Backoff's usleep) the data they wait for.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/host-xhost-diag}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/host_xhost_diag.log") 2>&1
B=build-host
if [ ! -x $B/bench/epcomm-bench ]; then
  meson setup $B -Dcuda=disabled > /dev/null && ninja -C $B bench/epcomm-bench src/launcher/epcomm-run > /dev/null || exit 1
fi
nproc; uptime
A=(--hidden 2048 --topk 8 --experts 256 --ht-tokens 1024 --iters 20 --warmup 2)
run() {  # label, ranks, hosts, env...
  local l=$1 n=$2 h=$3; shift 3
  echo "### $l -n $n --hosts $h"
  env "$@" EPCOMM_ENGINE=host EPCOMM_NET=socket timeout 120 $B/src/launcher/epcomm-run -n $n --hosts $h -- \
    $B/bench/epcomm-bench --ops ht,ll "${A[@]}" 2>&1 | grep -E '^(HT|LL|net raw) |rror'
}
for n in 4 8; do
  echo "## (a) -n $n, 2 virtual hosts"
  run default $n 2
  if [ -n "${SHORT:-}" ]; then run channels=1 $n 2 EPCOMM_HOST_CHANNELS=1; continue; fi  # default against 1 only
  for c in 1 2 4; do run channels=$c $n 2 EPCOMM_HOST_CHANNELS=$c; done
  run queue=4MiB $n 2 EPCOMM_QUEUE_BYTES=4194304
  run no-sleep $n 2 EPCOMM_BACKOFF_YIELDS=100000
  echo "## (b) -n $n, one host: cross-memory attach, then through the queues (as across hosts), 1 and 4 channels"
  run one-host $n 1
  run one-host-queues $n 1 EPCOMM_HOST_CMA=0
  for c in 1 4; do run one-host-queues-channels=$c $n 1 EPCOMM_HOST_CMA=0 EPCOMM_HOST_CHANNELS=$c; done
done
echo "## (c) per-thread CPU, -n 4 --hosts 2, HT dispatch + combine, 1500 iterations (still running when sampled)"
EPCOMM_ENGINE=host EPCOMM_NET=socket timeout 120 $B/src/launcher/epcomm-run -n 4 --hosts 2 -- \
  $B/bench/epcomm-bench --ops ht "${A[@]:0:8}" --iters 1500 --warmup 2 --net-raw-mb 0 > "$OUT/diag-long.txt" 2>&1 &
sleep 4
# CPU of every thread of the ranks over 2 s, from /proc (the device machine has no perf; top may be missing too).
pids=$(pgrep -f 'bench/epcomm-bench --ops ht' | tr '\n' ' ')
python3 - $pids <<'PY'
import os, sys, time
def snap():
    d = {}
    for pid in sys.argv[1:]:
        try: tids = os.listdir(f"/proc/{pid}/task")
        except OSError: continue
        for t in tids:
            try: f = open(f"/proc/{pid}/task/{t}/stat").read()
            except OSError: continue
            name = f[f.index("(") + 1:f.rindex(")")]; v = f[f.rindex(")") + 2:].split()
            d[(pid, t)] = (name, int(v[11]) + int(v[12]))  # utime + stime, clock ticks
    return d
a = snap(); time.sleep(2); b = snap(); hz = os.sysconf("SC_CLK_TCK")
rows = sorted(((b[k][1] - a[k][1]) / hz / 2 * 100, k, b[k][0]) for k in b if k in a)
print("%CPU over 2 s  pid  tid  thread"); [print("%6.1f  %s  %s  %s" % (c, k[0], k[1], n)) for c, k, n in reversed(rows)]
print("total %.0f %% of one core, %d threads" % (sum(r[0] for r in rows), len(rows)))
PY
pids=$(echo $pids | tr ' ' ',')
if command -v perf > /dev/null && [ -n "$pids" ]; then
  echo "## (d) perf, 3 s"
  perf record -o "$OUT/diag.perf" -F 999 -g -p "$pids" -- sleep 3 > /dev/null 2>&1
  perf report -i "$OUT/diag.perf" --no-children --sort comm,symbol -g none --percent-limit 1 2>/dev/null | grep '%' | head -40
fi
wait
grep -E '^HT' "$OUT/diag-long.txt"
