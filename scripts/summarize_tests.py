#!/usr/bin/env python3
"""Counts the results of a `meson test` run and prints the closing line

    N passed, N failed, N skipped

as the last line of its output. The counts are of test *programs*, read from meson's testlog.json (one JSON
object per line, with a "result" field): OK and EXPECTEDFAIL pass; SKIP (the program exited 77) is skipped;
everything else (FAIL, TIMEOUT, ERROR, UNEXPECTEDPASS, INTERRUPT, anything unknown) fails.

With --pytest-junit, the test cases of the Python suite (pytest's JUnit XML) are added to the counts, one per
case; a missing or unreadable file counts as one failure (the suite did not run to its end).

With --junit, an informational line before it also counts the individual test cases of the gtest programs
(from meson's testlog.junit.xml; a program that is not gtest counts as one case there).

Exit status: 0 when at least one program passed and none failed; 1 otherwise (a failure, no test run at all,
or a missing log).

  summarize_tests.py build/meson-logs/testlog.json [--junit build/meson-logs/testlog.junit.xml]
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
    ap.add_argument("testlog", nargs="?", help="meson's testlog.json")
    ap.add_argument("--junit", help="meson's testlog.junit.xml, for per-case counts")
    ap.add_argument("--pytest-junit", help="pytest's --junitxml file: its cases are added to the counts")
    ap.add_argument("--clean-gtest-xml", metavar="BUILD_DIR", help="remove stale gtest XML files and exit")
    args = ap.parse_args(argv)

    if args.clean_gtest_xml:
        return clean_gtest_xml(args.clean_gtest_xml)
    if not args.testlog:
        ap.error("the path of testlog.json is required")

    if not os.path.isfile(args.testlog):
        print(f"summarize_tests: {args.testlog} does not exist: no test ran", file=sys.stderr)
        sys.stderr.flush()
        print(closing_line(0, 0, 0))
        return 1

    passed, failed, skipped, failed_names, problems = count_programs(args.testlog)
    if args.pytest_junit:
        cases = count_cases(args.pytest_junit)
        if cases is None:
            print(f"summarize_tests: {args.pytest_junit} is missing or unreadable: the Python suite did not finish",
                  file=sys.stderr)
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
    if args.junit:
        cases = count_cases(args.junit)
        if cases is not None:
            print("test cases (each gtest case; other programs as one): passed=%d failed=%d skipped=%d" % cases)
    if passed + failed == 0:
        print("no test ran" + (f" ({skipped} skipped)" if skipped else ""))
    print(closing_line(passed, failed, skipped))
    sys.stdout.flush()
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
