#!/usr/bin/python3
"""Compiles every header under INCLUDE/ddp on its own (a translation unit holding just its #include), so a
header that leans on another one's includes fails here. Headers whose path matches SKIP (a regex) are left
out; the flags after it go to the compiler.

usage: headers_alone.py COMPILER INCLUDE SKIP [FLAGS...]
"""

import concurrent.futures
import os
import re
import subprocess
import sys


def check(compiler, flags, header):
    source = f'#include <{header}>\n'
    proc = subprocess.run([compiler, '-std=c++20', '-fsyntax-only', '-x', 'c++', *flags, '-'], input=source,
                          capture_output=True, text=True)
    return header, proc.returncode, proc.stderr


def main():
    compiler, include, skip, *flags = sys.argv[1:]
    headers = sorted(os.path.relpath(os.path.join(d, f), include)
                     for d, _, files in os.walk(os.path.join(include, 'ddp')) for f in files if f.endswith('.hpp'))
    headers = [h for h in headers if not re.search(skip, '/' + h)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda h: check(compiler, flags, h), headers))
    failed = [(h, err) for h, rc, err in results if rc != 0]
    for h, err in failed:
        print(f'{h} does not compile on its own; include what it uses:\n{err}')
    print(f'{len(headers) - len(failed)} of {len(headers)} headers compile on their own')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
