# Sourced by the bench/gpu session scripts: one definition of what each of them needs on the device machine.
#   gpu_build DIR        a CUDA build of this tree in build-gpu/ (kept between calls while the machine is warm),
#                        staged into DIR with scripts/gpu_stage.sh (test_gpu_ht, test_gpu_ll, epcomm-bench,
#                        epcomm-run, libepcomm); nothing is done if DIR already holds them
#   mps_start            a private CUDA MPS daemon for the rank processes, stopped when the script exits
#   b DIR CHAIN RANKS [VAR=VALUE ...]
#                        the LL rows of DIR's epcomm-bench (arguments in the array BARGS) at EPCOMM_GPU_LL_PDL_CHAIN
#   el                   seconds since the script started
T0=${T0:-$(date +%s)}
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
