#!/bin/bash
# The next session's device calls (written in s27, when no device was lent; s27's staged builds and branches did not
# survive into a fresh checkout, so this builds main on the device: build-gpu/, staged into .gpumain).
#   bash bench/gpu/s28-run.sh bench  (build + ~90 s)  issue 9's goal shape (R = 2, 64 tokens, 64 experts, hidden
#                                    7168, chain 2), 4 rounds: on an H200 this answers "<= 13 us" for the zero-copy
#                                    dispatch (14.0 on an H100 in s26); the standard shape at R = 2, 4, 8
#   bash bench/gpu/s28-run.sh suite  (~480 s) test_gpu_ll at R = 8 and at R = 4 across 2 virtual hosts (s26's
#                                    lastFlags, 55e6648, ran only at R = 2, 4 on one host), test_gpu_ht at R = 2
#   bash bench/gpu/s28-run.sh san    (~540 s) compute-sanitizer on test_gpu_ll at R = 2 (lastFlags has not been under
#                                    the tools), with the out-of-bounds proof
#   bash bench/gpu/s28-run.sh host   (~240 s) bench/net/host_xhost_diag.sh: issue 12's host engine on the 16 cores
#   bash bench/gpu/s28-run.sh quick  (build + ~300 s) for a session that gets one call: common.sh's quick on this
#                                    build (what is still open on one GPU), then `host` while the call lasts
# Run bench first (it builds); the others reuse .gpumain while the machine stays warm, else build again.
# (s28 itself ran bench/gpu/s28-ab.sh on staged builds; every start but two failed and both calls got an H100.)
cd "$(dirname "$0")/../.."
part=${1:-bench}
source bench/gpu/common.sh
gpu_log s28 $part
if [ "$part" = host ]; then OUT=$OUT bash bench/net/host_xhost_diag.sh; el; exit 0; fi
gpu_build .gpumain || { echo "### build failed"; exit 1; }; el
if [ "$part" = san ]; then san_ll .gpumain; exit 0; fi
if [ "$part" = quick ]; then quick .gpumain; exit 0; fi
mps_start
if [ "$part" = bench ]; then
  goal .gpumain 4
  echo "## (b) standard shape (128 tokens, 256 experts, --iters 20), R = 2, 4, 8"
  BARGS=(--iters 20)
  for R in 2 4 8; do b .gpumain 1 $R; done; el
fi
if [ "$part" = suite ]; then suite .gpumain; fi
