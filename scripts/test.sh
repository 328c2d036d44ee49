#!/usr/bin/env bash
# Builds epcomm (scripts/setup.sh), runs every test suite — meson's (C/C++) and the Python suite
# (scripts/test_python.sh: torch from PyPI, the package built with pip, pytest) — and closes with one line
#   N passed, N failed, N skipped
# counted over the test programs meson ran (a skipped program exited 77) plus the pytest cases. Exits non-zero
# when a test failed or when no test ran at all. Arguments go to `meson test` (e.g. --suite unit, or a test
# name); EPCOMM_PYTHON_TESTS=0 leaves the Python suite out. EPCOMM_TEST_SUMMARY=0 leaves the closing line to
# the caller (.ci/run sums this, the Python suite and the ASan stage in one line).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"

LOG=build/meson-logs/testlog.json
rm -f "$LOG" build/meson-logs/testlog.junit.xml  # no stale results if meson test cannot run
python3 scripts/summarize_tests.py --clean-gtest-xml build
test_rc=0
meson test -C build --print-errorlogs --num-processes 1 "$@" || test_rc=$?

PYTEST_ARGS=()
if [ "${EPCOMM_PYTHON_TESTS:-1}" != 0 ]; then
  PYTEST_XML=build/pytest.junit.xml
  bash scripts/test_python.sh "$PYTEST_XML" || test_rc=$?
  PYTEST_ARGS=(--pytest-junit "$PYTEST_XML")
fi
if [ "${EPCOMM_TEST_SUMMARY:-1}" = 0 ]; then exit "$test_rc"; fi

summary_rc=0
python3 scripts/summarize_tests.py "$LOG" --junit build/meson-logs/testlog.junit.xml "${PYTEST_ARGS[@]}" || summary_rc=$?
if [ "$summary_rc" -ne 0 ]; then exit "$summary_rc"; fi
exit "$test_rc"
