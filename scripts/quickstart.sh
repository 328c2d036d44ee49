#!/usr/bin/env bash
# Builds epcomm (scripts/setup.sh) and runs the benchmark on 4 ranks of this machine through epcomm-run.
# Arguments go to the benchmark: scripts/quickstart.sh --help lists them. EPCOMM_NRANKS changes the rank count.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec build/src/launcher/epcomm-run -n "${EPCOMM_NRANKS:-4}" -- build/bench/epcomm-bench "$@"
