#!/usr/bin/env bash
# The wheel as a newcomer gets it: `pip wheel ./python` builds a platform
# wheel with libvmmipc.so inside (check_wheel.py), pip installs it into a
# fresh venv, and the README's Python quick start
# (examples/python/quickstart.py) then runs from an empty directory outside
# the checkout, with no VMMIPC_* or PYTHONPATH variable, and prints b'HELLO'.
# Building must leave the source tree as it was.
#
#   tests/install/test_wheel.sh PYTHON WORKDIR
set -euo pipefail
[ $# = 2 ] || { echo "usage: $0 PYTHON WORKDIR" >&2; exit 2; }
python=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$2"
mkdir -p "$2"
work=$(cd "$2" && pwd)

tree_state() { git -C "$root" status --porcelain --ignored --untracked-files=all -- python 2>/dev/null || true; }
before=$(tree_state)

echo "wheel: $python -m venv $work/venv"
"$python" -m venv "$work/venv"
venv_python=$work/venv/bin/python
echo "wheel: pip wheel ./python (scikit-build-core from PyPI; the library built through CMakeLists.txt)"
"$venv_python" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$root/python"
wheel=$(ls "$work"/dist/vmmipc-*.whl)
"$venv_python" "$root/tests/install/check_wheel.py" "$wheel"
"$venv_python" -m pip install --quiet --no-deps "$wheel"

elsewhere=$(mktemp -d)
trap 'rm -rf "$elsewhere"' EXIT
echo "wheel: running examples/python/quickstart.py from $elsewhere"
out=$(cd "$elsewhere" && env -u PYTHONPATH -u VMMIPC_LIBRARY "$venv_python" "$root/examples/python/quickstart.py")
if [ "$out" != "b'HELLO'" ]; then
  echo "wheel: the quick start printed $out, want b'HELLO'" >&2
  exit 1
fi

after=$(tree_state)
if [ "$before" != "$after" ]; then
  echo "wheel: building left files in python/:" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
echo "wheel: OK: the installed wheel's quick start printed $out; source tree unchanged"
