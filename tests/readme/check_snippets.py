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

A block of program output names the C program that prints it on the line
before, and each of its lines must be one that a printf of that program can
print (its format, with any number or text where a conversion stands):

    <!-- output: tests/c/demo.c -->

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
OUTPUT_MARKER = re.compile(r"^<!-- output: (\S+) -->$")
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


def printf_lines(path: str) -> list[tuple[str, re.Pattern]]:
    """(format, pattern) for each line a printf(...) of a C file prints; the
    format's adjacent string literals joined, split at each \\n. Formats with
    no text of their own ("%s\\n") would match anything and are left out."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    literal = r'"((?:[^"\\\n]|\\.)*)"'
    found = []
    for call in re.finditer(r"(?<![\w.])printf\(\s*((?:" + literal + r"\s*)+)", source):
        text = "".join(m.group(1) for m in re.finditer(literal, call.group(1)))
        text = re.sub(r'\\(.)', lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), text)
        for line in text.split("\n"):
            if line and CONVERSION.sub("", line).strip():
                found.append((line, re.compile(format_pattern(line))))
    return found


CONVERSION = re.compile(r"%[-+ #0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|z|j|t|L)?([diouxXeEfgGcsp%])")


def format_pattern(fmt: str) -> str:
    """A regular expression matching what printf prints for fmt."""
    kinds = {"d": r" *-?\d+", "i": r" *-?\d+", "u": r" *\d+", "o": r" *[0-7]+", "x": r" *[0-9a-f]+",
             "X": r" *[0-9A-F]+", "c": ".", "s": ".*?", "p": r"0x[0-9a-f]+|\(nil\)", "%": "%"}
    number = r" *-?(?:\d+(?:\.\d*)?(?:e[+-]?\d+)?|inf|nan)"
    out, at = [], 0
    for m in CONVERSION.finditer(fmt):
        out.append(re.escape(fmt[at:m.start()]))
        out.append("(?:" + kinds.get(m.group(1), number) + ")")
        at = m.end()
    out.append(re.escape(fmt[at:]))
    return "".join(out)


def output_problems(lines: list[str]) -> tuple[int, list[str]]:
    """Output blocks checked, and what is wrong with them."""
    checked, problems = 0, []
    for i, line in enumerate(lines[:-1]):
        marker = OUTPUT_MARKER.match(line.rstrip("\n"))
        if not marker:
            continue
        program = os.path.join(ROOT, marker.group(1))
        if not os.path.exists(program):
            problems.append(f"README.md:{i + 1}: no program {marker.group(1)}")
            continue
        if lines[i + 1].rstrip("\n") != "```":
            problems.append(f"README.md:{i + 1}: the output marker is not followed by a ``` block")
            continue
        formats = printf_lines(program)
        end = i + 2
        while end < len(lines) and lines[end].rstrip("\n") != "```":
            printed = lines[end].rstrip("\n")
            if printed and not any(p.fullmatch(printed) for _, p in formats):
                problems.append(f"README.md:{end + 1}: {marker.group(1)} prints no such line:\n  {printed}\n"
                                "its lines:\n" + "".join(f"  {f}\n" for f, _ in formats)
                                + "  run it and paste what it prints")
            end += 1
        checked += 1
    return checked, problems


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
    outputs, problems = output_problems(lines)
    errors += problems
    for error in errors:
        print(f"readme: {error}", file=sys.stderr)
    if errors:
        return 1
    print(f"readme: the {compiled + skipped} code blocks of README.md are excerpts of examples/; "
          f"{compiled} compile (C) or parse (Python) as printed, {skipped} not compiled here; "
          f"the {outputs} output block(s) are lines their program prints")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args not in ([], ["--update"]):
        sys.exit(__doc__)
    sys.exit(main(update=args == ["--update"]))
