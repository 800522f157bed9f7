#!/usr/bin/env python3
"""Writes single_include/ddp/ddp.hpp: the umbrella headers (UMBRELLAS: training, checkpoints, logging, the
launcher) with every <ddp/...> header inlined once, so the one file carries all a user of include/ includes.

Deterministic (no timestamps, no absolute paths): the same headers give the same bytes. System
includes stay as they are (repeats at top level are dropped). A header first met inside a
preprocessor conditional (e.g. `#if defined(DDP_WITH_MPI)`) is wrapped in its own guard, so it is
still defined when a later unconditional include needs it, and the backend guards keep working.

    python3 scripts/amalgamate.py           # regenerate
    python3 scripts/amalgamate.py --check   # exit 1 when the committed single header is stale
    python3 scripts/amalgamate.py --include /tmp/head/include   # from another tree's headers, e.g.
                                            # `git archive HEAD include | tar -x -C /tmp/head`
"""

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "include"
OUTPUT = ROOT / "single_include" / "ddp" / "ddp.hpp"
REGENERATE = "python3 scripts/amalgamate.py"
UMBRELLAS = ("ddp/ddp.hpp", "ddp/checkpoint.hpp", "ddp/log.hpp", "ddp/launch.hpp")

DDP_INCLUDE = re.compile(r'^\s*#\s*include\s*<(ddp/[^>]+)>')
SYSTEM_INCLUDE = re.compile(r'^\s*#\s*include\s*<([^>]+)>\s*$')
QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"')
PRAGMA_ONCE = re.compile(r'^\s*#\s*pragma\s+once\b')
OPENS = re.compile(r'^\s*#\s*if(n?def)?\b')
CLOSES = re.compile(r'^\s*#\s*endif\b')
BRANCHES = re.compile(r'^\s*#\s*(else|elif)\b')


class Amalgamator:
    def __init__(self, include):
        self.include = include
        self.out = []
        self.levels = [set()]        # per open #if block (level 0: none), the headers inlined in its branch
        self.conditional = set()     # headers inlined inside an #if at least once: guard every copy
        self.stack = []              # headers being inlined, to report cycles
        self.system = set()          # system headers already included at top level

    def guard(self, path):
        return "DDP_SINGLE_HEADER_" + re.sub(r'[^A-Za-z0-9]', '_', path).upper()

    def inline(self, path):
        if path in self.stack or any(path in level for level in self.levels):
            return  # already defined on this path through the conditionals
        source = self.include / path
        if not source.is_file():
            where = self.stack[-1] if self.stack else "the umbrella header"
            sys.exit(f"amalgamate: {where} includes <{path}>, which is not under {self.include}")
        guarded = len(self.levels) > 1 or path in self.conditional
        if len(self.levels) > 1:
            self.conditional.add(path)
        self.levels[-1].add(path)
        self.stack.append(path)
        self.out.append(f"// ---- begin <{path}>")
        if guarded:
            self.out += [f"#ifndef {self.guard(path)}", f"#define {self.guard(path)}"]
        for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
            self.line(path, number, line)
        if guarded:
            self.out.append(f"#endif  // {self.guard(path)}")
        self.out.append(f"// ---- end <{path}>")
        self.stack.pop()

    def line(self, path, number, line):
        if PRAGMA_ONCE.match(line):
            return
        if QUOTED_INCLUDE.match(line):
            sys.exit(f"amalgamate: include/{path}:{number} uses a quoted include; write #include <ddp/...>")
        m = DDP_INCLUDE.match(line)
        if m:
            self.inline(m.group(1))
            return
        m = SYSTEM_INCLUDE.match(line)
        if m and len(self.levels) == 1:
            if m.group(1) in self.system:
                return
            self.system.add(m.group(1))
        if OPENS.match(line):
            self.levels.append(set())
        elif BRANCHES.match(line):
            self.levels[-1] = set()
        elif CLOSES.match(line):
            if len(self.levels) == 1:
                sys.exit(f"amalgamate: include/{path}:{number} has an #endif without its #if")
            self.levels.pop()
        self.out.append(line)

    def text(self):
        head = [
            "#pragma once",
            "// ddp: data-parallel training for any C++ model, as one header.",
            "// Generated from include/" + ", include/".join(UMBRELLAS),
            "// by scripts/amalgamate.py; do not edit.",
            f"// Regenerate with: {REGENERATE}",
            "// The MPI and NCCL backends are compiled in when DDP_WITH_MPI / DDP_WITH_NCCL are defined",
            "// (the ddp::mpi and ddp::nccl CMake targets define them), exactly as with include/.",
        ]
        for umbrella in UMBRELLAS:
            self.inline(umbrella)
        if len(self.levels) != 1:
            sys.exit("amalgamate: unbalanced #if/#endif in the headers")
        return "\n".join(head + self.out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 when single_include/ddp/ddp.hpp differs from a fresh build")
    parser.add_argument("--include", type=pathlib.Path, default=INCLUDE,
                        help="the include/ folder to read the headers from (default: this checkout's)")
    args = parser.parse_args()
    text = Amalgamator(args.include.resolve()).text()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.is_file() else None
        if current != text:
            state = "is missing" if current is None else "is stale (the headers under include/ changed)"
            print(f"single_include/ddp/ddp.hpp {state}; regenerate it with: {REGENERATE}", file=sys.stderr)
            return 1
        print("single_include/ddp/ddp.hpp is fresh")
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote single_include/ddp/ddp.hpp ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
