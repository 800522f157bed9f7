#!/usr/bin/env python3
"""Fails when the version differs between CMakeLists.txt's project(), the Conan recipe and the vcpkg port, the
three places a release must change together.

    python3 scripts/check_versions.py [ROOT]
"""

import json
import pathlib
import re
import sys


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    found = {}
    cmake = re.search(r"project\(\s*ddp\s+VERSION\s+([0-9.]+)", (root / "CMakeLists.txt").read_text())
    found["CMakeLists.txt project()"] = cmake.group(1) if cmake else None
    conan = re.search(r'^\s*version\s*=\s*"([^"]+)"', (root / "packaging/conan/conanfile.py").read_text(), re.M)
    found["packaging/conan/conanfile.py"] = conan.group(1) if conan else None
    for port in sorted((root / "packaging/vcpkg").rglob("vcpkg.json")):
        manifest = json.loads(port.read_text())
        found[str(port.relative_to(root))] = manifest.get("version", manifest.get("version-semver"))
    versions = set(found.values())
    if None in versions or len(versions) != 1:
        listed = ", ".join(f"{where}: {v or 'none found'}" for where, v in found.items())
        print(f"the versions differ ({listed}); give all of them the release's version", file=sys.stderr)
        return 1
    print(f"version {versions.pop()} in {len(found)} places")
    return 0


if __name__ == "__main__":
    sys.exit(main())
