#!/usr/bin/env bash
# The wheel as a newcomer gets it: `pip wheel ./python` builds a manylinux
# wheel with libvmmipc.so inside, check_wheel.py checks its contents and,
# with auditwheel, that the library needs no glibc newer than the tag says;
# pip installs it into a fresh venv with no Go on PATH, and the README's
# Python quick start (examples/python/quickstart.py) then runs from an empty
# directory outside the checkout and loads the installed library. Building
# must leave the source tree as it was. The wheel's library is left in
# WORKDIR/lib/libvmmipc.so, for the C suite to run against it (make
# test-wheel).
#
# pip fetches the build's requirements (scikit-build-core, ziglang) into its
# own isolated environment, and auditwheel into WORKDIR/tools; nothing goes
# into PYTHON's own site-packages.
#
#   tests/install/test_wheel.sh PYTHON WORKDIR
set -euo pipefail
. "$(dirname "$0")/python_env.sh"
start_install_test "$0" "$@"

echo "wheel: $python -m venv $work/tools, with auditwheel"
"$python" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install --quiet "auditwheel>=6.8,<7"
echo "wheel: pip wheel ./python (scikit-build-core and ziglang from PyPI; the library built through CMakeLists.txt)"
"$work/tools/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$root/python"
python_tree_unchanged "$root" "$before" "building the wheel"
wheel=$(ls "$work"/dist/vmmipc-*.whl)
"$work/tools/bin/python" "$root/tests/install/check_wheel.py" "$wheel"
mkdir "$work/lib"
"$work/tools/bin/python" -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("vmmipc/libvmmipc.so"))' \
  "$wheel" "$work/lib/libvmmipc.so"

echo "wheel: installing $(basename "$wheel") into a fresh venv, $work/venv, with no go on PATH"
"$python" -m venv "$work/venv"
PATH=$(path_without_go) "$work/venv/bin/python" -m pip install --quiet --no-index --no-deps "$wheel"
quickstart_elsewhere "$root" "$work/venv"
echo "wheel: OK: $(basename "$wheel") installs and runs without Go; source tree unchanged"
