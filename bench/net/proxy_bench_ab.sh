#!/bin/bash
# Same-run comparison of proxy_bench builds (bench/results/cpu-proxy-s19.log):
#   BINS="pb.base pb.new" PBDIR=dir bench/net/proxy_bench_ab.sh N proxy_bench-args...
# runs the binaries named in $BINS (copies of build*/bench/net/proxy_bench, in $PBDIR, default the current folder)
# alternately, N rounds, prints each run's result line, then per binary the medians of raw GB/s, proxy GB/s,
# proxy/raw, raw ns/B and proxy ns/B. A run still going after $LIMIT seconds (default 40) is killed with its forked
# ranks (its process group) and reported as TIMEOUT.
N=$1; shift
D=${PBDIR:-.}
L=${LIMIT:-40}
tmp=$(mktemp); o=$(mktemp)
for i in $(seq 1 $N); do
  for b in $BINS; do
    setsid $D/$b "$@" > $o 2>&1 & pid=$!
    ( sleep $L; kill -9 -- -$pid 2>/dev/null && echo "$b TIMEOUT after $L s" ) & w=$!
    wait $pid; kill $w 2>/dev/null; wait $w 2>/dev/null
    out=$(grep -E "^[0-9]+ +[0-9.]+ " $o | tail -1); grep -i "warn\|error\|proxy_bench: rank" $o | head -3 >&2
    echo "$b $out" | tee -a $tmp
  done
done
for b in $BINS; do
  grep "^$b " $tmp | python3 -c "
import sys, statistics as st
rows=[list(map(float,l.split()[2:7])) for l in sys.stdin if len(l.split())>=7]
m=[st.median(c) for c in zip(*rows)] if rows else [0]*5
print('median %-10s n=%d raw %.2f GB/s proxy %.2f GB/s proxy/raw %.3f  raw %.3f ns/B proxy %.3f ns/B' % ('$b', len(rows), *m))"
done
rm -f $tmp $o
