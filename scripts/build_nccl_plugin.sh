# Sourced by the NCCL plugin scripts: builds libnccl-net-epcomm.so (host code only: no CUDA needed for it) in
# $BUILD_DIR (default build-nccl-net) and sets PLUGIN to its absolute path.
BUILD="${BUILD_DIR:-build-nccl-net}"
if [ ! -f "$BUILD/build.ninja" ]; then
  meson setup "$BUILD" --wrap-mode=nodownload -Dcuda=disabled -Dtests=false -Dbuildtype=release
fi
ninja -C "$BUILD" plugin/nccl/libnccl-net-epcomm.so
PLUGIN="$(pwd)/$BUILD/plugin/nccl/libnccl-net-epcomm.so"
