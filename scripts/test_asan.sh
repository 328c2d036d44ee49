#!/usr/bin/env bash
# The AddressSanitizer stage: builds epcomm and its tests host-only with -Db_sanitize=address into build-asan/
# (beside build/, which stays as it is) and runs the unit suite there, the API fuzz test included. Like
# scripts/test.sh it ends with "N passed, N failed, N skipped" and exits non-zero when a test failed;
# EPCOMM_TEST_SUMMARY=0 leaves the closing line to the caller (.ci/run sums both stages in one line).
# Arguments go to `meson test` (e.g. a test name). Needs what scripts/setup.sh installs (run it first).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
BUILD=build-asan

# A sanitizer report fails the test that triggered it. Forked ranks end with _exit, so leak checks would only
# see the parent; they stay on for it.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}"
# The fuzz test runs about five times slower here: a fifth of its CI seeds keeps it near a minute.
export EPCOMM_FUZZ_SEEDS="${EPCOMM_FUZZ_SEEDS:-1-30}"

OPTS=(--wrap-mode=nodownload -Dbuildtype=debugoptimized -Db_sanitize=address -Db_lundef=false -Dcuda=disabled)
if [ -f "$BUILD/meson-private/coredata.dat" ]; then
  meson setup --reconfigure "$BUILD" "${OPTS[@]}" >/dev/null || meson setup --wipe "$BUILD" "${OPTS[@]}"
else
  meson setup "$BUILD" "${OPTS[@]}"
fi
ninja -C "$BUILD" -j "${EPCOMM_JOBS:-$(nproc)}"

LOG="$BUILD/meson-logs/testlog.json"
rm -f "$LOG" "$BUILD/meson-logs/testlog.junit.xml"
python3 scripts/summarize_tests.py --clean-gtest-xml "$BUILD"
test_rc=0
meson test -C "$BUILD" --suite unit --print-errorlogs --num-processes 1 --timeout-multiplier 3 "$@" || test_rc=$?

if [ "${EPCOMM_TEST_SUMMARY:-1}" = 0 ]; then exit "$test_rc"; fi
summary_rc=0
python3 scripts/summarize_tests.py "$LOG" --junit "$BUILD/meson-logs/testlog.junit.xml" || summary_rc=$?
if [ "$summary_rc" -ne 0 ]; then exit "$summary_rc"; fi
exit "$test_rc"
