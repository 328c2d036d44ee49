#!/usr/bin/env bash
# GPU-machine benchmark: NCCL all_reduce and all_to_all bus bandwidth (8 KiB .. 256 MiB) over the epcomm plugin
# (socket, and ofi when libfabric is present) and over NCCL's built-in Socket transport (NCCL_NET=Socket, no
# plugin), in the same run, with the epcomm/NCCL ratio per size. Ranks are processes on ONE GPU under a private
# CUDA MPS daemon, each with its own NCCL_HOSTID (so all traffic crosses the network transport).
#
#   bash scripts/nccl_bench_gpu.sh     # env: PYTHON (python3), WORLDS ("2 4"), OFI_PROVIDER ("tcp;ofi_rxm"),
#                                      #      BUILD_DIR (build-nccl-net); EPCOMM_NET_* tune the plugin
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
status=0
for w in $WORLDS; do
  "$PYTHON" bench/net/nccl_bus_bw.py --plugin "$PLUGIN" --world "$w" --configs "$CONFIGS" \
    --ofi-provider "${OFI_PROVIDER:-tcp;ofi_rxm}" || status=1
done
exit "$status"
