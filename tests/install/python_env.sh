# What test_wheel.sh and test_editable.sh share (sourced, not run): their start, a PATH
# without Go, the state of python/ in git, and the README's Python quick
# start run the way a user of the installed package runs it.

# PATH without any directory that holds a `go`: what the installed package
# must work with (the library is built; Go is a build tool only).
path_without_go() {
  local dir kept=
  local IFS=:
  for dir in $PATH; do
    [ -n "$dir" ] && [ ! -x "$dir/go" ] && kept=$kept${kept:+:}$dir
  done
  echo "$kept"
}

# start_install_test "$0" PYTHON WORKDIR: checks a test's arguments and sets
# python, root (the checkout), work (WORKDIR, emptied, absolute) and before
# (python/'s state, for python_tree_unchanged).
start_install_test() {
  [ $# = 3 ] || { echo "usage: $1 PYTHON WORKDIR" >&2; exit 2; }
  python=$2
  root=$(cd "$(dirname "$1")/../.." && pwd)
  rm -rf "$3" && mkdir -p "$3"
  work=$(cd "$3" && pwd)
  before=$(python_tree_state "$root")
}

# python/ as git sees it, ignored files included: a build must not change it.
python_tree_state() {
  git -C "$1" status --porcelain --ignored --untracked-files=all -- python 2>/dev/null || true
}

# python_tree_unchanged ROOT BEFORE WHAT: fails, showing the difference, when
# ROOT's python/ is no longer as BEFORE (python_tree_state) recorded it.
python_tree_unchanged() {
  local after
  after=$(python_tree_state "$1")
  if [ "$2" != "$after" ]; then
    echo "install test: $3 left files in python/:" >&2
    diff <(echo "$2") <(echo "$after") >&2 || true
    return 1
  fi
}

# quickstart_elsewhere ROOT VENV: runs examples/python/quickstart.py with
# VENV's Python from an empty directory outside the checkout, with no Go on
# PATH and no VMMIPC_* or PYTHONPATH variable; it must print b'HELLO'. Then
# checks, in the same conditions, that `import vmmipc` loads the libvmmipc.so
# inside VENV (not the checkout's build/libvmmipc.so, say). Prints where the
# package and the library were found.
quickstart_elsewhere() {
  local root=$1 venv=$2 elsewhere nogo out where library
  nogo=$(path_without_go)
  if PATH=$nogo command -v go >/dev/null; then
    echo "install test: go is still on the PATH meant to have none: $nogo" >&2
    return 1
  fi
  elsewhere=$(mktemp -d)
  echo "install test: running examples/python/quickstart.py from $elsewhere, no go on PATH"
  out=$(cd "$elsewhere" && env -u PYTHONPATH -u VMMIPC_LIBRARY PATH="$nogo" \
    "$venv/bin/python" "$root/examples/python/quickstart.py") || { rm -rf "$elsewhere"; return 1; }
  where=$(cd "$elsewhere" && env -u PYTHONPATH -u VMMIPC_LIBRARY PATH="$nogo" "$venv/bin/python" -c \
    "import vmmipc; vmmipc.version(); print(vmmipc.__file__); \
print([l.split()[-1] for l in open('/proc/self/maps') if 'libvmmipc' in l][0])") ||
    { rm -rf "$elsewhere"; return 1; }
  rm -rf "$elsewhere"
  if [ "$out" != "b'HELLO'" ]; then
    echo "install test: the quick start printed $out, want b'HELLO'" >&2
    return 1
  fi
  library=${where##*$'\n'}
  echo "install test: quick start printed $out; vmmipc from ${where%%$'\n'*}, library $library"
  case $library in
    "$venv"/*) ;;
    *) echo "install test: vmmipc loaded $library, not the libvmmipc.so installed in $venv" >&2
       return 1 ;;
  esac
}
