#!/usr/bin/env bash
# GPU-machine check of the NCCL net plugin: builds libnccl-net-epcomm.so, starts a private CUDA MPS daemon,
# and runs tests/net/nccl_torch_check.py (torch.distributed 'nccl': all_reduce, all_gather, reduce_scatter,
# all_to_all_single, broadcast, send/recv) with 2 and 4 ranks as processes on ONE GPU, each its own NCCL_HOSTID,
# first with EPCOMM_NET=socket, then EPCOMM_NET=ofi (providers in OFI_PROVIDERS) when libfabric is present.
#
#   bash scripts/nccl_plugin_gpu.sh            # env: PYTHON (default python3), WORLDS ("2 4"),
#                                              #      OFI_PROVIDERS ("tcp;ofi_rxm shm"), BUILD_DIR (build-nccl-net)
# Prints PASS/FAIL per op and backend; exit code 0 only when everything that ran passed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
WORLDS="${WORLDS:-2 4}"
OFI_PROVIDERS="${OFI_PROVIDERS:-tcp;ofi_rxm shm}"
LOGS="$(mktemp -d -t epcomm-nccl-logs.XXXXXX)"

# shellcheck source=scripts/build_nccl_plugin.sh
source scripts/build_nccl_plugin.sh
echo "plugin: $PLUGIN"

# --- private MPS daemon: ranks sharing the GPU run concurrently instead of time-slicing ---------------------------
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d -t epcomm-mps-pipe.XXXXXX)"
export CUDA_MPS_LOG_DIRECTORY="$(mktemp -d -t epcomm-mps-log.XXXXXX)"
cleanup() {
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
}
trap cleanup EXIT
nvidia-cuda-mps-control -d
"$PYTHON" -c 'import torch, torch.cuda.nccl as n; print("torch", torch.__version__, "NCCL", n.version(), "GPU", torch.cuda.get_device_name(0))'

status=0
run() {  # $1 = label; env already set
  for w in $WORLDS; do
    if ! "$PYTHON" tests/net/nccl_torch_check.py --plugin "$PLUGIN" --world "$w" --log-dir "$LOGS"; then status=1; fi
  done
}

echo "=== EPCOMM_NET=socket"
EPCOMM_NET=socket run socket

# ofi: needs libfabric at run time (dlopen) and its headers at build time (else the backend is a stub).
if ! ldconfig -p 2>/dev/null | grep -q 'libfabric\.so\.1'; then
  echo "=== EPCOMM_NET=ofi: SKIPPED — libfabric.so.1 is not installed on this machine (apt-get install libfabric1)"
elif ! grep -q EPCOMM_HAVE_OFI "$BUILD/build.ninja"; then
  echo "=== EPCOMM_NET=ofi: SKIPPED — the plugin was built without libfabric headers (apt-get install libfabric-dev, then rm -rf $BUILD)"
else
  IFS=' ' read -r -a provs <<<"$OFI_PROVIDERS"
  for p in "${provs[@]}"; do
    echo "=== EPCOMM_NET=ofi EPCOMM_OFI_PROVIDER=$p"
    EPCOMM_NET=ofi EPCOMM_OFI_PROVIDER="$p" run "ofi-$p"
  done
fi
echo "logs: $LOGS"
[ "$status" -eq 0 ] && echo "nccl_plugin_gpu: ALL PASS" || echo "nccl_plugin_gpu: FAILURES (see above)"
exit "$status"
