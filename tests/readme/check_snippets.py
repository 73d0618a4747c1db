"""README.md's code is excerpts of the examples, which `make test` builds and
runs; this check fails when the two drift apart.

In an example, an excerpt is the lines between a line holding
"readme-snippet: NAME" and a line holding "end readme-snippet" (in a comment
of the file's language). In README.md, the line right before a fenced block
names the excerpt the block must equal:

    <!-- snippet: examples/host/sender.c host-sender -->

Checked: every such block equals its excerpt, byte for byte; every C or
Python block of README.md is such a block; every excerpt in examples/ is
shown; every C block compiles as printed (cc -fsyntax-only -Wall -Wextra
-Werror against include/vmmipc.h; one that includes <cuda.h> only where
cuda.h is found, else it says so) and every Python block parses.

    python3 tests/readme/check_snippets.py            # check
    python3 tests/readme/check_snippets.py --update   # copy the excerpts into README.md
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
EXAMPLES = os.path.join(ROOT, "examples")

MARKER = re.compile(r"^<!-- snippet: (\S+) (\S+) -->$")
FENCE = re.compile(r"^```(\w*)$")
REGION_BEGIN = re.compile(r"readme-snippet: (\S+)")
REGION_END = "end readme-snippet"


def excerpts(path: str) -> dict[str, str]:
    """The named excerpts of one example file."""
    found: dict[str, str] = {}
    name, lines = None, []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if REGION_END in line:
                if name is None:
                    raise SystemExit(f"{path}:{number}: '{REGION_END}' without a 'readme-snippet: NAME' before it")
                found[name] = "".join(lines)
                name = None
            elif (begin := REGION_BEGIN.search(line)):
                if name is not None:
                    raise SystemExit(f"{path}:{number}: excerpt {begin.group(1)} starts inside excerpt {name}")
                if begin.group(1) in found:
                    raise SystemExit(f"{path}:{number}: a second excerpt named {begin.group(1)}")
                name, lines = begin.group(1), []
            elif name is not None:
                lines.append(line)
    if name is not None:
        raise SystemExit(f"{path}: excerpt {name} has no '{REGION_END}' line")
    return found


def all_excerpts() -> dict[tuple[str, str], str]:
    """(path relative to the root, name) -> text, for every excerpt in examples/."""
    found = {}
    for directory, _, files in os.walk(EXAMPLES):
        for file in sorted(files):
            path = os.path.join(directory, file)
            if file.endswith((".c", ".h", ".py")):
                for name, text in excerpts(path).items():
                    found[(os.path.relpath(path, ROOT), name)] = text
    return found


@dataclasses.dataclass
class Block:
    """A fenced block of README.md."""

    language: str
    first: int  # 0-based index of its first line = the 1-based number of its opening fence
    last: int  # index of its closing fence
    text: str
    source: tuple[str, str] | None  # (file, excerpt) its marker names


def blocks(lines: list[str]) -> list[Block]:
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i].rstrip("\n"))
        if not fence or not fence.group(1):
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].rstrip("\n") != "```":
            end += 1
        if end == len(lines):
            raise SystemExit(f"README.md:{i + 1}: the ``` block never closes")
        marker = MARKER.match(lines[i - 1].rstrip("\n")) if i > 0 else None
        found.append(Block(fence.group(1), i + 1, end, "".join(lines[i + 1:end]),
                           (marker.group(1), marker.group(2)) if marker else None))
        i = end + 1
    return found


def cuda_include() -> str | None:
    """The directory holding cuda.h, or None."""
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    include = os.path.join(cuda_home, "include")
    return include if os.path.exists(os.path.join(include, "cuda.h")) else None


def compile_problem(block: Block, where: str) -> str | None:
    """None if the block compiles (C) or parses (Python) as printed."""
    if block.language == "python":
        try:
            compile(block.text, where, "exec")
        except SyntaxError as e:
            return f"{where} does not parse: {e}"
        return None
    flags = ["-I" + os.path.join(ROOT, "include")]
    if uses_cuda(block):
        flags.append("-I" + cuda_include())
    with tempfile.NamedTemporaryFile("w", suffix=".c") as source:
        source.write(block.text)
        source.flush()
        command = shlex.split(os.environ.get("CC", "cc")) + [
            "-std=gnu11", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *flags, source.name]
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return f"{where} does not compile as printed ({' '.join(command)}):\n{result.stderr}"
    return None


def uses_cuda(block: Block) -> bool:
    return block.language == "c" and "#include <cuda.h>" in block.text


def main(update: bool) -> int:
    with open(README, encoding="utf-8") as f:
        lines = f.readlines()
    known = all_excerpts()
    errors, shown = [], set()
    found = blocks(lines)
    for block in reversed(found):  # from the end, so --update keeps earlier line numbers valid
        if block.source is None:
            if block.language in ("c", "python"):
                errors.append(f"README.md:{block.first}: a {block.language} block that is no excerpt: put the "
                              "code in examples/ and name it on the line before: <!-- snippet: FILE NAME -->")
            continue
        shown.add(block.source)
        if block.source not in known:
            errors.append(f"README.md:{block.first - 1}: no excerpt {block.source[1]} in {block.source[0]}")
            continue
        want = known[block.source]
        if block.text == want:
            continue
        if update:
            lines[block.first:block.last] = want.splitlines(keepends=True)
            print(f"readme: README.md:{block.first}: copied {block.source[0]} {block.source[1]}")
            continue
        diff = "".join(difflib.unified_diff(
            want.splitlines(keepends=True), block.text.splitlines(keepends=True),
            f"{block.source[0]} ({block.source[1]})", f"README.md:{block.first}"))
        errors.append(f"README.md:{block.first}: differs from {block.source[0]} {block.source[1]}; "
                      f"run python3 tests/readme/check_snippets.py --update to copy it:\n{diff}")
    for path, name in sorted(set(known) - shown):
        errors.append(f"{path}: excerpt {name} is not shown in README.md (<!-- snippet: {path} {name} -->)")
    if update:
        with open(README, "w", encoding="utf-8") as f:
            f.writelines(lines)
        found = blocks(lines)
    compiled, skipped = 0, 0
    for block in found:
        if block.source not in known:
            continue
        where = f"README.md:{block.first} ({block.source[0]} {block.source[1]})"
        if uses_cuda(block) and cuda_include() is None:
            print(f"readme: not compiling {where}: no cuda.h under CUDA_HOME "
                  f"({os.environ.get('CUDA_HOME', '/usr/local/cuda')})")
            skipped += 1
        elif (problem := compile_problem(block, where)) is not None:
            errors.append(problem)
        else:
            compiled += 1
    for error in errors:
        print(f"readme: {error}", file=sys.stderr)
    if errors:
        return 1
    print(f"readme: the {compiled + skipped} code blocks of README.md are excerpts of examples/; "
          f"{compiled} compile (C) or parse (Python) as printed, {skipped} not compiled here")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args not in ([], ["--update"]):
        sys.exit(__doc__)
    sys.exit(main(update=args == ["--update"]))
