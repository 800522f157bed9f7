#!/usr/bin/env python3
"""The docs lint: every header path README.md and docs/ name exists, so a renamed or removed header cannot leave the
documentation pointing at nothing. It checks `include/ddp/...` paths, `<ddp/...>` includes and
room-relative header names (`parallel/strategy.hpp`), and the relative
links between the Markdown files (the part before any #anchor).

usage: check_docs.py [ROOT]   (ROOT: the repository, default the parent of this script's folder)
"""
import pathlib
import re
import sys

HEADER = re.compile(r"(?:include/|<)(ddp/[A-Za-z0-9_./]+\.(?:hpp|cuh))")
ROOMS = "core|comm|memory|parallel|optim|cuda|data|checkpoint|io|launch|log|adapters"
ROOM_HEADER = re.compile(r"(?<![\w/.])((?:" + ROOMS + r")/[A-Za-z0-9_./]+\.(?:hpp|cuh))")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def problems(root):
    docs = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            for header in HEADER.findall(line) + ["ddp/" + h for h in ROOM_HEADER.findall(line)]:
                if not (root / "include" / header).is_file():
                    yield f"{doc.relative_to(root)}:{number}: names {header}, which include/ does not hold"
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                if not (doc.parent / target).exists():
                    yield f"{doc.relative_to(root)}:{number}: links to {target}, which does not exist"


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    found = list(problems(root))
    for p in found:
        print(p)
    print(f"check_docs: {len(found)} problem(s)" + ("; fix the path or the link" if found else ""))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
