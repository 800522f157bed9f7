#!/usr/bin/env python3
"""Fails when a Catch2 TEST_CASE name under tests/ holds a semicolon: catch_discover_tests splits names at ';',
and the ctest entries it then makes match no test case, run nothing and still pass."""
import pathlib
import re
import sys

CASE = re.compile(r'TEST_CASE\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)', re.S)
LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')


def main() -> int:
    root = pathlib.Path(__file__).resolve().parent.parent / "tests"
    bad = []
    for path in sorted(root.rglob("*.cpp")):
        for m in CASE.finditer(path.read_text()):
            name = "".join(LITERAL.findall(m.group(1)))
            if ";" in name:
                bad.append(f"{path.relative_to(root.parent)}: {name}")
    for line in bad:
        print(f"test name holds ';' (ctest would split it and run nothing; use ',' instead): {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
