#!/usr/bin/env bash
# An editable install as a contributor makes one: `pip install -e ./python`
# into a fresh venv builds the library (scikit-build-core, the same build as
# the wheel's) and puts it in the venv's site-packages/vmmipc/, while
# `import vmmipc` imports the checkout's python/vmmipc/. The README's Python
# quick start then runs from an empty directory outside the checkout, with no
# Go on PATH, and must load the library the editable build installed, not the
# checkout's build/libvmmipc.so. Installing must leave the source tree as it
# was.
#
#   tests/install/test_editable.sh PYTHON WORKDIR
set -euo pipefail
. "$(dirname "$0")/python_env.sh"
start_install_test "$0" "$@"

echo "editable: $python -m venv $work/venv; pip install -e ./python"
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet -e "$root/python"
python_tree_unchanged "$root" "$before" "installing"
package=$(cd / && "$work/venv/bin/python" -c 'import vmmipc; print(vmmipc.__file__)')
if [ "$package" != "$root/python/vmmipc/__init__.py" ]; then
  echo "editable: vmmipc is imported from $package, not from the checkout's python/vmmipc/" >&2
  exit 1
fi
quickstart_elsewhere "$root" "$work/venv"
echo "editable: OK: the editable install imports python/vmmipc/ and loads its own build of the library"
