"""Checks a built vmmipc wheel: a platform wheel (Root-Is-Purelib false)
that carries vmmipc/libvmmipc.so (an ELF file whose symbols name
vmmipc_version) next to the package's modules, and the LICENSE; tagged
manylinux_2_28 or older, and, by `auditwheel show`, needing no glibc newer
than its tag and no library outside the manylinux policy. Run with a Python
that has auditwheel 6.8 or later (for --json).

    python check_wheel.py dist/vmmipc-<version>-py3-none-manylinux_2_28_x86_64.whl
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile

REQUIRED = ("vmmipc/__init__.py", "vmmipc/_lib.py", "vmmipc/libvmmipc.so")
# The oldest glibc README.md promises: RHEL 8's (Ubuntu 20.04 has 2.31).
OLDEST_GLIBC = (2, 28)
MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")


def glibc(tag: str) -> tuple[int, int] | None:
    """(major, minor) of a manylinux_X_Y_<arch> platform tag, else None."""
    m = MANYLINUX.match(tag)
    return (int(m.group(1)), int(m.group(2))) if m else None


def contents_problems(path: str) -> list[str]:
    found = []
    name = os.path.basename(path)
    with zipfile.ZipFile(path) as wheel:
        names = set(wheel.namelist())
        found += [f"{name} lacks {member}" for member in REQUIRED if member not in names]
        if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
            found.append(f"{name} carries no LICENSE (.dist-info/licenses/LICENSE)")
        metadata = [n for n in names if n.endswith(".dist-info/WHEEL")]
        if not metadata or b"Root-Is-Purelib: false" not in wheel.read(metadata[0]):
            found.append(f"{name}: its WHEEL metadata does not say Root-Is-Purelib: false")
        if "vmmipc/libvmmipc.so" in names:
            library = wheel.read("vmmipc/libvmmipc.so")
            if library[:4] != b"\x7fELF":
                found.append("vmmipc/libvmmipc.so is not an ELF file")
            elif b"vmmipc_version" not in library:
                found.append("vmmipc/libvmmipc.so has no vmmipc_version symbol")
    return found


def tag_problems(path: str) -> list[str]:
    """The platform tag against what auditwheel finds the library needs."""
    name = os.path.basename(path)
    # {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
    platform_tag = name[: -len(".whl")].split("-")[-1]
    tagged = glibc(platform_tag)
    if tagged is None:
        return [f"{name}: platform tag {platform_tag} is not manylinux_X_Y_<arch>: PyPI refuses it "
                "(python/pyproject.toml's override sets the tag)"]
    found = []
    if tagged > OLDEST_GLIBC:
        found.append(f"{name}: tagged for glibc {tagged[0]}.{tagged[1]}, newer than "
                     f"{OLDEST_GLIBC[0]}.{OLDEST_GLIBC[1]}, the oldest README.md promises")
    r = subprocess.run([sys.executable, "-m", "auditwheel", "show", "--json", path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return found + [f"auditwheel show {name} failed ({r.returncode}): {r.stderr.strip()}"]
    report = json.loads(r.stdout)
    if report.get("error"):
        return found + [f"auditwheel show {name}: {report['error']}"]
    needed = report["overall_tag"]
    print(f"wheel: auditwheel: the library is consistent with {needed} "
          f"(symbol versions: {report['versioned_symbols']})")
    required = glibc(needed)
    if required is None:
        found.append(f"auditwheel finds {name} consistent with {needed} only, no manylinux tag "
                     f"(libraries outside the policy: {report['external_libs'] or 'none'}; "
                     f"unsupported ISA: {report['unsupported_isa']})")
    elif required > tagged:
        found.append(f"{name} is tagged {platform_tag}, but its library needs {needed}: "
                     "it was not built by zig cc against the tag's glibc (CMakeLists.txt, VMMIPC_GLIBC)")
    elif MANYLINUX.match(needed).group(3) != MANYLINUX.match(platform_tag).group(3):
        found.append(f"{name}: the library is for {needed}, the tag says {platform_tag}")
    if not found:
        print(f"wheel: {name}: tag {platform_tag} (glibc {tagged[0]}.{tagged[1]} or newer) holds")
    return found


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    errors = contents_problems(sys.argv[1])
    errors += tag_problems(sys.argv[1])
    for error in errors:
        print(f"wheel: {error}", file=sys.stderr)
    sys.exit(1 if errors else 0)
