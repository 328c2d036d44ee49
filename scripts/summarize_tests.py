#!/usr/bin/env python3
"""Counts the results of a `meson test` run and prints the closing line

    N passed, N failed, N skipped

as the last line of its output. The counts are of test *programs*, read from meson's testlog.json (one JSON
object per line, with a "result" field): OK and EXPECTEDFAIL pass; SKIP (the program exited 77) is skipped;
everything else (FAIL, TIMEOUT, ERROR, UNEXPECTEDPASS, INTERRUPT, anything unknown) fails.

With --junit, an informational line before it also counts the individual test cases of the gtest programs
(from meson's testlog.junit.xml; a program that is not gtest counts as one case there).

With --pytest-junit, the test cases of the Python suite (pytest's JUnit XML) are added to the counts, one per
case; a missing or unreadable file counts as one failure (the suite did not run to its end).

Several logs (the stages of one CI run, e.g. the normal build and the AddressSanitizer build) are summed into
the one closing line; with more than one log, a missing log counts as one failed program (its stage did not
run to the end).

Exit status: 0 when at least one program passed and none failed; 1 otherwise (a failure, no test run at all,
or a missing log).

  summarize_tests.py build/meson-logs/testlog.json [--junit build/meson-logs/testlog.junit.xml]
  summarize_tests.py build/meson-logs/testlog.json build-asan/meson-logs/testlog.json \
      [--junit build/meson-logs/testlog.junit.xml --junit build-asan/meson-logs/testlog.junit.xml] \
      [--pytest-junit build/pytest.junit.xml]
  summarize_tests.py --clean-gtest-xml build    # before `meson test`: removes gtest XML of earlier runs
"""
import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET

PASSED = {"OK", "EXPECTEDFAIL"}
SKIPPED = {"SKIP"}
FAILED_KNOWN = {"FAIL", "TIMEOUT", "ERROR", "UNEXPECTEDPASS", "INTERRUPT"}


def closing_line(passed, failed, skipped):
    return f"{passed} passed, {failed} failed, {skipped} skipped"


def count_programs(log_path):
    """Returns (passed, failed, skipped, failed_names, problems) from a testlog.json."""
    passed = failed = skipped = 0
    failed_names, problems = [], []
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                entry = json.loads(line)
                result = str(entry["result"]).upper()
                name = str(entry.get("name", f"line {lineno}"))
            except (ValueError, KeyError, TypeError) as e:
                failed += 1  # a log we cannot read is not a pass
                problems.append(f"{log_path}:{lineno}: unreadable entry ({e})")
                continue
            if result in PASSED:
                passed += 1
            elif result in SKIPPED:
                skipped += 1
            else:
                failed += 1
                failed_names.append(f"{name} ({result})")
                if result not in FAILED_KNOWN:
                    problems.append(f"{name}: unknown result {result!r}, counted as failed")
    return passed, failed, skipped, failed_names, problems


def count_cases(junit_path):
    """Returns (passed, failed, skipped) over every <testcase> of meson's JUnit log, or None."""
    try:
        root = ET.parse(junit_path).getroot()
    except (OSError, ET.ParseError):
        return None
    passed = failed = skipped = 0
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            failed += 1
        elif "skipped" in tags or case.get("status") == "notrun":
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def clean_gtest_xml(build_dir):
    """meson reads <name>.xml after a gtest program; a stale one from an earlier run would be taken for the
    results of a program that crashed this time. Removes those files, as listed in meson's introspection."""
    intro = os.path.join(build_dir, "meson-info", "intro-tests.json")
    try:
        with open(intro, encoding="utf-8") as f:
            tests = json.load(f)
    except (OSError, ValueError):
        return 0
    for t in tests:
        if t.get("protocol") != "gtest":
            continue
        path = os.path.join(t.get("workdir") or build_dir, f"{t['name']}.xml")
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            print(f"summarize_tests: cannot remove {path}: {e}", file=sys.stderr)
    return 0


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("testlog", nargs="*", help="meson's testlog.json, one per stage")
    ap.add_argument("--junit", action="append", default=[], help="meson's testlog.junit.xml, for per-case counts")
    ap.add_argument("--pytest-junit", help="pytest's --junitxml file: its cases are added to the counts")
    ap.add_argument("--clean-gtest-xml", metavar="BUILD_DIR", help="remove stale gtest XML files and exit")
    args = ap.parse_args(argv)

    if args.clean_gtest_xml:
        return clean_gtest_xml(args.clean_gtest_xml)
    if not args.testlog:
        ap.error("the path of testlog.json is required")

    passed = failed = skipped = 0
    failed_names, problems = [], []
    for log in args.testlog:
        if not os.path.isfile(log):
            problems.append(f"{log} does not exist: no test ran")
            if len(args.testlog) > 1:  # a stage that did not run to the end
                failed += 1
                failed_names.append(f"{log} (MISSING)")
            continue
        p, f, s, names, probs = count_programs(log)
        passed, failed, skipped = passed + p, failed + f, skipped + s
        stage = os.path.dirname(os.path.dirname(log)) or "."
        failed_names += [f"{stage}: {n}" for n in names] if len(args.testlog) > 1 else names
        problems += probs
    if args.pytest_junit:
        cases = count_cases(args.pytest_junit)
        if cases is None:
            problems.append(f"{args.pytest_junit} is missing or unreadable: the Python suite did not finish")
            failed += 1
            failed_names.append(f"python suite ({args.pytest_junit} missing)")
        else:
            print("python suite (pytest cases): passed=%d failed=%d skipped=%d" % cases)
            passed, failed, skipped = passed + cases[0], failed + cases[1], skipped + cases[2]
    for p in problems:
        print(f"summarize_tests: {p}", file=sys.stderr)
    sys.stderr.flush()
    if failed_names:
        print("failed:")
        for n in failed_names:
            print(f"  {n}")
    cases = [c for c in (count_cases(j) for j in args.junit) if c is not None]
    if cases:
        print("test cases (each gtest case; other programs as one): passed=%d failed=%d skipped=%d"
              % tuple(sum(c[i] for c in cases) for i in range(3)))
    if passed + failed == 0:
        print("no test ran" + (f" ({skipped} skipped)" if skipped else ""))
    print(closing_line(passed, failed, skipped))
    sys.stdout.flush()
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
