#!/usr/bin/env bash
# GPU-machine benchmark: nccl-tests-style bus bandwidth of every collective (all_reduce, all_gather,
# reduce_scatter, broadcast, reduce, all_to_all, sendrecv; 8 KiB .. 256 MiB) over the epcomm plugin
# (socket, and ofi when libfabric is present) and over NCCL's built-in Socket transport (NCCL_NET=Socket, no
# plugin), in the same run, with the epcomm/NCCL ratio per size. Ranks are processes on ONE GPU under a private
# CUDA MPS daemon, each with its own NCCL_HOSTID (so all traffic crosses the network transport).
#
#   bash scripts/nccl_bench_gpu.sh     # env: PYTHON (python3), WORLDS ("2 4"), OFI_PROVIDER ("tcp;ofi_rxm"),
#                                      #      BUILD_DIR (build-nccl-net); EPCOMM_NET_* tune the plugin;
#                                      #      OPS ("all" or e.g. "broadcast,all_gather"), SIZES ("" or "8K,32K,128K"),
#                                      #      BEFORE_PLUGIN (another build's .so: measured too, as epcomm-before),
#                                      #      EXTRA_CONFIGS (e.g. "epcomm-socket+EPCOMM_NET_INLINE=262144"),
#                                      #      ROUNDS (the configs run this many times, interleaved; median per cell),
#                                      #      REPS (timed batches per cell within one run; their median),
#                                      #      ITERS_SCALE (scales the collectives per batch: 20 up to 4 MiB)
# nccl-tests is not on the GPU machine (no network there to fetch or build it), so the sweep runs NCCL's kernels
# through torch.distributed; bench/net/nccl_bus_bw.py reports sizes and busbw the way nccl-tests does.
# Goal: >= 2x NCCL Socket at >= 16 MiB, >= 1.3x at >= 1 MiB, never below 1.0x.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
WORLDS="${WORLDS:-2 4}"
# shellcheck source=scripts/build_nccl_plugin.sh
source scripts/build_nccl_plugin.sh

export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d -t epcomm-mps-pipe.XXXXXX)"
export CUDA_MPS_LOG_DIRECTORY="$(mktemp -d -t epcomm-mps-log.XXXXXX)"
cleanup() {
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
}
trap cleanup EXIT
nvidia-cuda-mps-control -d

CONFIGS="epcomm-socket,nccl-socket"
if ldconfig -p 2>/dev/null | grep -q 'libfabric\.so\.1' && grep -q EPCOMM_HAVE_OFI "$BUILD/build.ninja"; then
  CONFIGS="epcomm-socket,epcomm-ofi,nccl-socket"
else
  echo "# epcomm-ofi not measured: libfabric (runtime libfabric1, headers libfabric-dev at build) is not available here"
fi
if [ -n "${BEFORE_PLUGIN:-}" ]; then CONFIGS="$CONFIGS,epcomm-socket+NCCL_NET_PLUGIN=$(realpath "$BEFORE_PLUGIN")"; fi
if [ -n "${EXTRA_CONFIGS:-}" ]; then CONFIGS="$CONFIGS,$EXTRA_CONFIGS"; fi
status=0
for w in $WORLDS; do
  "$PYTHON" bench/net/nccl_bus_bw.py --plugin "$PLUGIN" --world "$w" --configs "$CONFIGS" \
    --ofi-provider "${OFI_PROVIDER:-tcp;ofi_rxm}" --ops "${OPS:-all}" --sizes "${SIZES:-}" \
    --rounds "${ROUNDS:-1}" --reps "${REPS:-1}" --iters-scale "${ITERS_SCALE:-1}" || status=1
done
exit "$status"
