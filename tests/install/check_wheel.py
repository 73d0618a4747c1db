"""Checks a built vmmipc wheel: a platform wheel (its platform tag is this
machine's kind, not "any"; Root-Is-Purelib false) that carries
vmmipc/libvmmipc.so (an ELF file whose symbols name vmmipc_version) next to
the package's modules.

    python check_wheel.py dist/vmmipc-<version>-py3-none-linux_x86_64.whl
"""

import os
import sys
import zipfile

REQUIRED = ("vmmipc/__init__.py", "vmmipc/_lib.py", "vmmipc/libvmmipc.so")


def problems(path: str) -> list[str]:
    found = []
    name = os.path.basename(path)
    # {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
    python_tag, abi_tag, platform_tag = name[: -len(".whl")].split("-")[-3:]
    if platform_tag == "any":
        found.append(f"{name} is tagged for any platform; a wheel with libvmmipc.so inside must name its platform")
    with zipfile.ZipFile(path) as wheel:
        names = set(wheel.namelist())
        found += [f"{name} lacks {member}" for member in REQUIRED if member not in names]
        metadata = [n for n in names if n.endswith(".dist-info/WHEEL")]
        if not metadata or b"Root-Is-Purelib: false" not in wheel.read(metadata[0]):
            found.append(f"{name}: its WHEEL metadata does not say Root-Is-Purelib: false")
        if "vmmipc/libvmmipc.so" in names:
            library = wheel.read("vmmipc/libvmmipc.so")
            if library[:4] != b"\x7fELF":
                found.append("vmmipc/libvmmipc.so is not an ELF file")
            elif b"vmmipc_version" not in library:
                found.append("vmmipc/libvmmipc.so has no vmmipc_version symbol")
    if not found:
        print(f"wheel: {name}: tags {python_tag}-{abi_tag}-{platform_tag}, "
              f"libvmmipc.so inside ({len(library)} bytes)")
    return found


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    errors = problems(sys.argv[1])
    for error in errors:
        print(f"wheel: {error}", file=sys.stderr)
    sys.exit(1 if errors else 0)
