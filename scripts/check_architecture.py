#!/usr/bin/python3
"""Checks the rules docs/architecture.md states for include/ddp/, so that the map and the code cannot drift:

1. every header lies in a room of the rooms table (`| room | job | headers |`) and its name appears, in
   backticks, in that room's row (a row may name a header by its stem, its path inside the room, a prefix
   ending in `*`, or a folder ending in `/`);
2. every `#include <ddp/...>` of a header is allowed by the include matrix (`| room | includes |`): a room
   includes its own headers and those of the rooms, headers (`parallel/policies.hpp`) and umbrella headers
   (`ddp.hpp`) its row names in backticks;
3. the rooms' includes run one way: the graph of which room includes which (from the headers themselves) has no
   cycle, so every room sits above the rooms it includes.

usage: check_architecture.py [ROOT]   (ROOT: the repository, by default this script's parent folder's parent)
"""

import pathlib
import re
import sys

TICKED = re.compile(r'`([^`]+)`')
INCLUDE = re.compile(r'^\s*#\s*include\s*<ddp/([^>]+)>', re.M)


def tables(text):
    """Every markdown table of `text` as (header cells, rows of cells)."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith('|') and i + 1 < len(lines) and re.match(r'^\|[-| :]+\|$', lines[i + 1]):
            head = [c.strip() for c in lines[i].strip('|').split('|')]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith('|'):
                rows.append([c.strip() for c in lines[i].strip().strip('|').split('|')])
                i += 1
            out.append((head, rows))
        else:
            i += 1
    return out


def table(text, first, second):
    for head, rows in tables(text):
        if len(head) >= 2 and head[0] == first and head[1] == second:
            return rows
    raise SystemExit(f'docs/architecture.md has no table whose columns begin "| {first} | {second} |"')


def room_of(rel, rooms):
    """The deepest room (e.g. 'comm/tcp/') whose folder holds `rel` (a path under include/ddp/), else None."""
    best = None
    for r in rooms:
        if rel.startswith(r) and (best is None or len(r) > len(best)):
            best = r
    return best


def named(inside, tokens):
    """Whether a rooms-table row's backticked `tokens` name the header at path `inside` (relative to its room)."""
    path = inside.rsplit('.', 1)[0]
    stem = path.rsplit('/', 1)[-1]
    for t in tokens:
        t = t.removesuffix('.hpp').removesuffix('.cuh')
        if t in (path, stem) or (t.endswith('*') and path.startswith(t[:-1])) or \
                (t.endswith('/') and path.startswith(t)):
            return True
    return False


def cycles(uses):
    """A problem per room cycle in `uses` (room -> {room: the include that makes the edge}), with its includes."""
    found, done = [], set()

    def walk(room, path):
        if room in path:
            loop = path[path.index(room):] + [room]
            edges = '; '.join(uses[a][b] for a, b in zip(loop, loop[1:]))
            found.append(f'rooms include each other in a cycle ({" -> ".join(loop)}): {edges}; move the shared '
                         f'code down into a room all of them may include')
            return
        if room in done:
            return
        for target in sorted(uses.get(room, {})):
            walk(target, path + [room])
        done.add(room)

    for room in sorted(uses):
        walk(room, [])
    return found


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    text = (root / 'docs' / 'architecture.md').read_text()
    include = root / 'include' / 'ddp'
    rooms = {}
    for row in table(text, 'room', 'job'):
        names = TICKED.findall(row[0])
        if names:
            rooms[names[0]] = TICKED.findall(' '.join(row[1:]))
    allowed = {}
    for row in table(text, 'room', 'includes'):
        names = TICKED.findall(row[0])
        if names:
            allowed[names[0]] = set(TICKED.findall(row[1]))
    problems = []
    for r in rooms:
        if r.split('/')[0] + '/' not in allowed:
            problems.append(f'docs/architecture.md: room `{r}` has no row in the include matrix (| room | includes |)')
    headers = sorted(p for p in include.rglob('*') if p.suffix in ('.hpp', '.cuh'))
    uses = {}  # room -> {room it includes: the first include that makes it so}
    for h in headers:
        rel = h.relative_to(include).as_posix()
        if '/' not in rel:
            continue  # an umbrella header: it may include any room
        room = room_of(rel, rooms)
        if room is None:
            problems.append(f'include/ddp/{rel}: its folder is no room of docs/architecture.md\'s rooms table; '
                            f'add a row for it or move the header into a room')
            continue
        if not named(rel[len(room):], rooms[room]):
            problems.append(f'include/ddp/{rel}: missing from the `{room}` row of docs/architecture.md\'s rooms '
                            f'table; name it there with its job')
        top = rel.split('/')[0] + '/'
        may = allowed.get(top, set())
        for target in INCLUDE.findall(h.read_text()):
            target_room = target.split('/')[0] + '/' if '/' in target else None
            if target_room not in (None, top):
                uses.setdefault(top, {}).setdefault(target_room, f'include/ddp/{rel} includes <ddp/{target}>')
            if target_room == top or target in may or (target_room is not None and target_room in may):
                continue
            problems.append(f'include/ddp/{rel} includes <ddp/{target}>, which docs/architecture.md\'s include '
                            f'matrix does not allow `{top}` (it may include {", ".join(sorted(may)) or "nothing"}); '
                            f'move the code to a room both may use, or change the matrix with a reason')
    problems += cycles(uses)
    for p in problems:
        print(p)
    print(f'check_architecture: {len(headers)} headers, {len(rooms)} rooms: '
          f'{"no problem" if not problems else f"{len(problems)} problem(s)"}')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
