#!/usr/bin/env bash
# The host engine under injected faults: epcomm-soak (tests/soak/soak.cc) on every rank under epcomm-run, and
# beside it an injector that stops, resumes and kills ranks. Not part of the test suite (minutes, and the
# outcome of a fault depends on timing); run it after changes to waits, failure handling or resynchronization.
#
#   tests/soak/soak.sh SCENARIO HOSTS RANKS [VAR=value ...]      (BUILD=build by default)
#
# Scenarios (the victim ranks A, B are random unless given):
#   none        no fault (with SOAK_MISMATCH / SOAK_DESTROY: the driver's own hooks)
#   stopshort   ROUNDS (8) stops of a random rank for LO..HI s (0.3..1.2), below the deadline: no error may show
#   stoplong    ROUNDS (3) stops for LO..HI s (3..5), beyond the deadline, then resumed
#   kill1       rank A killed
#   kill2       A killed, then B after a gap of LO..HI s (0..3)
#   killresync  A killed, B killed the moment a survivor reports the failure (inside the resynchronization)
#   stopresync  A killed, B stopped for S s (3) the moment a survivor reports it, then resumed
# VAR=value pairs go to every rank (SOAK_*, see soak.cc; EPCOMM_NET=socket|ofi, EPCOMM_TIMEOUT_MS, ...) and the
# injector (A, B, LO, HI, ROUNDS, S). Logs: $OUT (default /tmp/epcomm-soak/<scenario>-<time>): log.<rank>,
# injector.log. Exit status 0 when every rank's summary is clean (no WRONG, LATE or RECOVERY FAILED line, no rank
# left running; a rank the injector stopped may be LATE: its calls include the stop), else 1. The driver's recovery
# follows the header: the dead are masked, and a rank whose connections the other hosts lost leaves.
# Examples (issue 12's cross-host failures; the first reproduced a resynchronization that succeeded on one rank):
#   tests/soak/soak.sh stopresync 3 6 SOAK_ITERS=250 SOAK_MODE=both SOAK_RECOVER=1 SOAK_RETRIES=30 \
#       EPCOMM_NET=socket EPCOMM_TIMEOUT_MS=2000 SOAK_TMO=2000
#   tests/soak/soak.sh none 2 4 SOAK_ITERS=6 SOAK_MISMATCH=1:2:barrier:htd SOAK_RECOVER=1 EPCOMM_TIMEOUT_MS=2000
set -u
SC=${1:?scenario}; H=${2:?hosts}; N=${3:?ranks}; shift 3
BUILD=${BUILD:-build}
RUN=$BUILD/src/launcher/epcomm-run; SOAK=$BUILD/tests/soak/epcomm-soak
[ -x "$RUN" ] && [ -x "$SOAK" ] || { echo "soak.sh: build first (ninja -C $BUILD): $RUN, $SOAK" >&2; exit 2; }
OUT=${OUT:-/tmp/epcomm-soak/$SC-$(date +%H%M%S)}
rm -rf "$OUT"; mkdir -p "$OUT"
for kv in "$@"; do export "$kv"; done
export SOAK_DIR=$OUT
TMO=${SOAK_TMO:-2000}
OUTER=${OUTER:-$(( (${SOAK_ITERS:-50} * 2) + 60 + 20 * TMO / 1000 ))}

log() { echo "[injector $(date +%s.%N | cut -c6-14)] $*" >> "$OUT/injector.log"; }
pid() { cat "$OUT/pid.$1"; }
rnd() { awk -v a="$1" -v b="$2" 'BEGIN { srand(); printf "%.3f", a + rand() * (b - a) }'; }
other() { echo $(( ($1 + 1 + RANDOM % (N - 1)) % N )); }  # a rank other than $1
victim() { touch "$OUT/victim.$1"; }                       # the survivors will mask it
wait_failure() { for _ in $(seq 2000); do grep -q 'error at iteration' "$OUT"/log.* 2>/dev/null && return; sleep 0.005; done; }
inject() {
  for _ in $(seq 200); do [ "$(ls "$OUT"/pid.[0-9]* 2>/dev/null | grep -vc '[.]tmp$')" -ge "$N" ] && break; sleep 0.1; done
  sleep 1
  case $SC in
    none) ;;
    stopshort|stoplong)
      local lo hi rounds
      if [ "$SC" = stopshort ]; then lo=${LO:-0.3}; hi=${HI:-1.2}; rounds=${ROUNDS:-8}; else lo=${LO:-3}; hi=${HI:-5}; rounds=${ROUNDS:-3}; fi
      for _ in $(seq "$rounds"); do
        local r=$((RANDOM % N)) d; d=$(rnd "$lo" "$hi")
        log "STOP rank $r for $d s"; kill -STOP "$(pid $r)"; sleep "$d"; kill -CONT "$(pid $r)"; log "CONT rank $r"
        sleep "$(rnd 0.5 2)"
      done ;;
    kill1)
      local a=${A:-$((RANDOM % N))}; sleep "$(rnd 0 1)"; log "KILL rank $a"; victim "$a"; kill -KILL "$(pid $a)" ;;
    kill2)
      local a=${A:-$((RANDOM % N))}; local b=${B:-$(other "$a")}; local g; g=$(rnd "${LO:-0}" "${HI:-3}")
      sleep "$(rnd 0 1)"; log "KILL rank $a"; victim "$a"; kill -KILL "$(pid $a)"
      sleep "$g"; log "KILL rank $b ($g s later)"; victim "$b"; kill -KILL "$(pid $b)" ;;
    killresync|stopresync)
      local a=${A:-$((RANDOM % N))}; local b=${B:-$(other "$a")}
      sleep "$(rnd 0 1)"; log "KILL rank $a"; victim "$a"; kill -KILL "$(pid $a)"
      wait_failure
      if [ "$SC" = killresync ]; then log "KILL rank $b after the failure showed"; victim "$b"; kill -KILL "$(pid $b)"
      else log "STOP rank $b after the failure showed"; kill -STOP "$(pid $b)"; sleep "${S:-3}"; kill -CONT "$(pid $b)"; log "CONT rank $b"; fi ;;
    *) log "unknown scenario $SC" ;;
  esac
  log done
}
inject & INJ=$!
EPCOMM_RUN_KILL_GRACE_MS=600000 timeout -s KILL "$OUTER" "$RUN" --hosts "$H" -n "$N" -- "$SOAK" > "$OUT/run.log" 2>&1
rc=$?
bad=0
for f in "$OUT"/pid.[0-9]*; do  # a rank still running after the launcher ended: a hang
  [ -e "$f" ] || continue
  p=$(cat "$f"); r=${f##*.}
  # (still this run's rank: the pid may have been reused)
  if kill -0 "$p" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ] &&
     tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q epcomm-soak; then
    echo "LEFTOVER rank $r (pid $p): stack in $OUT/stack.$r"; bad=1
    kill -CONT "$p"; timeout 60 gdb -p "$p" -batch -ex 'thread apply all bt' > "$OUT/stack.$r" 2>&1; kill -KILL "$p"
  fi
done
kill "$INJ" 2>/dev/null; wait "$INJ" 2>/dev/null
echo "== soak $SC, $H hosts x $N ranks: launcher status $rc; logs in $OUT"
sed 's/^/   /' "$OUT/injector.log" 2>/dev/null | head -20
grep -h SUMMARY "$OUT"/log.* | sed 's/^/   /'
# A stopped rank's own calls include the time it was stopped: its LATE lines are reported, not counted.
stopped=$(grep -o 'STOP rank [0-9]*' "$OUT/injector.log" 2>/dev/null | awk '{print $3}' | sort -u)
for f in "$OUT"/log.*; do
  r=${f##*.}
  if echo "$stopped" | grep -qx "$r"; then pat='WRONG|RECOVERY FAILED|INIT FAILED'; else pat='WRONG|LATE|RECOVERY FAILED|INIT FAILED'; fi
  if grep -h -E "$pat" "$f" | head -4 | sed 's/^/   !! /' | grep .; then bad=1; fi
done
for r in $stopped; do grep -h 'LATE' "$OUT/log.$r" 2>/dev/null | head -2 | sed 's/^/   (stopped rank, not counted) /'; done
for r in $(seq 0 $((N - 1))); do  # every rank not killed ends with its summary (or leaves, lost to the others)
  [ -e "$OUT/victim.$r" ] && continue
  if ! grep -q -E 'SUMMARY|leaving|destroying the communicator' "$OUT/log.$r" 2>/dev/null; then
    echo "   !! rank $r ended without a summary: $(tail -1 "$OUT/log.$r" 2>/dev/null | cut -c1-150)"; bad=1
  fi
done
exit $bad
