#!/usr/bin/env bash
# Prepares a Debian/Ubuntu machine to build epcomm and builds it into build/. Idempotent: every step is
# skipped when its result is already there, so running it again only rebuilds what changed.
#
#   1. system packages (apt-get, only when one is missing; sudo only when not root)
#   2. a Python virtual environment at .venv with meson (>=1.4,<2) and ninja
#   3. nvcc's folder on PATH when the CUDA toolkit is installed (without it, -Dcuda=auto builds no GPU code)
#   4. meson setup (or --reconfigure) of build/ and ninja
#
# Environment: EPCOMM_MESON_ARGS adds options to meson setup (e.g. "-Dcuda=disabled"); EPCOMM_JOBS sets
# ninja's parallelism (default: the number of cores); CUDA_HOME names the toolkit (default /usr/local/cuda).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { echo "setup: $*" >&2; }

# --- 1. System packages --------------------------------------------------------------------------------------
PACKAGES=(build-essential python3 python3-venv python3-pip ninja-build pkg-config libgtest-dev git libfabric-dev)
if command -v dpkg-query >/dev/null 2>&1; then
  missing=()
  for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then missing+=("$p"); fi
  done
  if ((${#missing[@]} > 0)); then
    SUDO=()
    if [ "$(id -u)" -ne 0 ]; then
      command -v sudo >/dev/null 2>&1 || { log "need root or sudo to install: ${missing[*]}"; exit 1; }
      SUDO=(sudo)
    fi
    log "installing ${missing[*]}"
    "${SUDO[@]}" apt-get update
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
  fi
else
  log "no dpkg here: not a Debian/Ubuntu system; assuming ${PACKAGES[*]} (or equivalents) are installed"
fi

# --- 2. Python tools in .venv --------------------------------------------------------------------------------
VENV="$ROOT/.venv"
if ! "$VENV/bin/python" -c 'pass' >/dev/null 2>&1; then  # missing, or broken (moved, Python upgraded)
  log "creating $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
fi
meson_ok() {
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
v = tuple(int(x) for x in md.version("meson").split(".")[:2])
md.version("ninja")
sys.exit(0 if (1, 4) <= v < (2, 0) else 1)
PY
}
if ! meson_ok || [ ! -x "$VENV/bin/meson" ] || [ ! -x "$VENV/bin/ninja" ]; then
  log "installing meson and ninja into $VENV"
  "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet 'meson>=1.4,<2' ninja
fi
export PATH="$VENV/bin:$PATH"

# --- 3. CUDA -------------------------------------------------------------------------------------------------
CUDA_BIN="${CUDA_HOME:-/usr/local/cuda}/bin"
if [ -x "$CUDA_BIN/nvcc" ]; then
  case ":$PATH:" in *":$CUDA_BIN:"*) ;; *) export PATH="$PATH:$CUDA_BIN" ;; esac
fi
if command -v nvcc >/dev/null 2>&1; then
  log "nvcc: $(command -v nvcc)"
else
  log "no nvcc: building without the GPU engine"
fi

# --- 4. Configure and build ----------------------------------------------------------------------------------
# shellcheck disable=SC2206  # EPCOMM_MESON_ARGS is a list of options, split on spaces on purpose
EXTRA=(${EPCOMM_MESON_ARGS:-})
OPTS=(--wrap-mode=nodownload -Dbuildtype=release "${EXTRA[@]}")
if [ -f build/meson-private/coredata.dat ]; then
  if ! meson setup --reconfigure build "${OPTS[@]}"; then
    log "reconfiguring build/ failed; configuring it afresh"
    meson setup --wipe build "${OPTS[@]}"
  fi
else
  meson setup build "${OPTS[@]}"
fi
ninja -C build -j "${EPCOMM_JOBS:-$(nproc)}"
log "done: build/ is up to date"
