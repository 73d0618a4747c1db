"""README.md and the documents under docs/ are checked as code is: their
code is excerpts of the examples, which `make test` builds and runs, their
links lead somewhere, and their sections stay short. This check fails when
any of that drifts.

In an example, an excerpt is the lines between a line holding
"readme-snippet: NAME" and a line holding "end readme-snippet" (in a comment
of the file's language). In a document, the line right before a fenced block
names the excerpt the block must equal:

    <!-- snippet: examples/host/sender.c host-sender -->

Checked, in README.md and docs/*.md: every such block equals its excerpt,
byte for byte; every C or Python block is such a block; every excerpt in
examples/ is shown in one of them; every C block compiles as printed
(cc -fsyntax-only -Wall -Wextra -Werror against include/vmmipc.h; one that
includes <cuda.h> only where cuda.h is found, else it says so); every Python
block parses and uses no name that it, or an earlier block of the same
example file in the same document, does not import or define.

A block of program output names the C program that prints it on the line
before, and each of its lines must be one that a printf of that program can
print (its format, with any number or text where a conversion stands):

    <!-- output: tests/c/demo.c -->

Links: every relative link of README.md, docs/*.md and python/README.md
leads to a file or directory of the repository, and an anchor (#section)
to a heading of the Markdown file it names (GitHub's anchors). Length:
README.md is at most 250 lines, and no section (## heading to the next) of
a document under docs/ is longer than 120 lines.

    python3 tests/readme/check_snippets.py            # check
    python3 tests/readme/check_snippets.py --update   # copy the excerpts into the documents
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import difflib
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
EXAMPLES = os.path.join(ROOT, "examples")
README_MAX_LINES = 250
SECTION_MAX_LINES = 120

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


def blocks(lines: list[str], doc: str = "README.md") -> list[Block]:
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
            raise SystemExit(f"{doc}:{i + 1}: the ``` block never closes")
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


def output_problems(lines: list[str], doc: str = "README.md") -> tuple[int, list[str]]:
    """Output blocks checked, and what is wrong with them."""
    checked, problems = 0, []
    for i, line in enumerate(lines[:-1]):
        marker = OUTPUT_MARKER.match(line.rstrip("\n"))
        if not marker:
            continue
        program = os.path.join(ROOT, marker.group(1))
        if not os.path.exists(program):
            problems.append(f"{doc}:{i + 1}: no program {marker.group(1)}")
            continue
        if lines[i + 1].rstrip("\n") != "```":
            problems.append(f"{doc}:{i + 1}: the output marker is not followed by a ``` block")
            continue
        formats = printf_lines(program)
        end = i + 2
        while end < len(lines) and lines[end].rstrip("\n") != "```":
            printed = lines[end].rstrip("\n")
            if printed and not any(p.fullmatch(printed) for _, p in formats):
                problems.append(f"{doc}:{end + 1}: {marker.group(1)} prints no such line:\n  {printed}\n"
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


def documents() -> list[str]:
    """README.md and docs/*.md, as paths relative to the root."""
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(DOCS, "*.md")))
    return ["README.md"] + docs


def check_excerpts(doc: str, lines: list[str], known: dict, shown: set, update: bool) -> list[str]:
    """The code blocks of one document against their excerpts; with update,
    copies the excerpts into lines."""
    errors = []
    for block in reversed(blocks(lines, doc)):  # from the end, so --update keeps earlier line numbers valid
        if block.source is None:
            if block.language in ("c", "python"):
                errors.append(f"{doc}:{block.first}: a {block.language} block that is no excerpt: put the "
                              "code in examples/ and name it on the line before: <!-- snippet: FILE NAME -->")
            continue
        shown.add(block.source)
        if block.source not in known:
            errors.append(f"{doc}:{block.first - 1}: no excerpt {block.source[1]} in {block.source[0]}")
            continue
        want = known[block.source]
        if block.text == want:
            continue
        if update:
            lines[block.first:block.last] = want.splitlines(keepends=True)
            print(f"readme: {doc}:{block.first}: copied {block.source[0]} {block.source[1]}")
            continue
        diff = "".join(difflib.unified_diff(
            want.splitlines(keepends=True), block.text.splitlines(keepends=True),
            f"{block.source[0]} ({block.source[1]})", f"{doc}:{block.first}"))
        errors.append(f"{doc}:{block.first}: differs from {block.source[0]} {block.source[1]}; "
                      f"run python3 tests/readme/check_snippets.py --update to copy it:\n{diff}")
    return errors


def bound_and_used(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names a block binds anywhere (imports, definitions, assignments,
    arguments, loop and with targets) and names it reads."""
    bound, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, used


def undefined_names(doc: str, lines: list[str]) -> list[str]:
    """Python blocks that use a name nothing imports or defines: not the
    block, not an earlier block of the same example file in this document,
    not Python's builtins."""
    errors, earlier = [], {}
    for block in blocks(lines, doc):
        if block.language != "python" or block.source is None:
            continue
        try:
            tree = ast.parse(block.text)
        except SyntaxError:
            continue  # compile_problem reports it
        bound, used = bound_and_used(tree)
        known = earlier.setdefault(block.source[0], set())
        missing = sorted(used - bound - known - set(dir(builtins)))
        if missing:
            errors.append(f"{doc}:{block.first}: {block.source[0]} {block.source[1]} uses "
                          f"{', '.join(missing)} without importing or defining it (in the excerpt or an "
                          "earlier excerpt of that file in this document): widen the excerpt")
        known |= bound
    return errors


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets
    -1, -2, ... as on GitHub); headings inside code blocks are none."""
    found, seen, fenced = set(), {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and (m := re.match(r"^#{1,6} (.+?)\s*#*$", line.rstrip("\n"))):
                base = slug(m.group(1))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
    return found


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def link_problems(doc: str) -> list[str]:
    """Relative links of one Markdown file that lead nowhere."""
    problems, fenced = [], False
    where = os.path.dirname(os.path.join(ROOT, doc))
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                continue
            for m in LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z]+:", target):
                    continue  # https:, mailto:
                path, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(where, path)) if path else os.path.join(ROOT, doc)
                if not full.startswith(ROOT + os.sep) and full != ROOT:
                    problems.append(f"{doc}:{number}: {target} leads out of the repository")
                elif not os.path.exists(full):
                    problems.append(f"{doc}:{number}: {target}: no such file")
                elif anchor and full.endswith(".md") and anchor not in anchors(full):
                    problems.append(f"{doc}:{number}: {target}: {os.path.relpath(full, ROOT)} has no heading "
                                    f"with the anchor #{anchor}")
    return problems


def length_problems(doc: str, lines: list[str]) -> list[str]:
    """README.md over its length, or a section of a document over its."""
    if doc == "README.md":
        if len(lines) > README_MAX_LINES:
            return [f"README.md: {len(lines)} lines, more than {README_MAX_LINES}: it is the front door; "
                    "move detail into docs/ and link it"]
        return []
    problems, start, title, fenced = [], 0, "(before the first ## heading)", False
    for i, line in enumerate(lines + ["## (end)\n"]):
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            if i - start > SECTION_MAX_LINES:
                problems.append(f"{doc}:{start + 1}: section {title} is {i - start} lines, more than "
                                f"{SECTION_MAX_LINES}: split it")
            start, title = i, line.strip()
    return problems


def main(update: bool) -> int:
    known = all_excerpts()
    errors, shown = [], set()
    compiled = skipped = outputs = 0
    docs = documents()
    for doc in docs:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            lines = f.readlines()
        errors += check_excerpts(doc, lines, known, shown, update)
        if update:
            with open(os.path.join(ROOT, doc), "w", encoding="utf-8") as f:
                f.writelines(lines)
        for block in blocks(lines, doc):
            if block.source not in known:
                continue
            where = f"{doc}:{block.first} ({block.source[0]} {block.source[1]})"
            if uses_cuda(block) and cuda_include() is None:
                print(f"readme: not compiling {where}: no cuda.h under CUDA_HOME "
                      f"({os.environ.get('CUDA_HOME', '/usr/local/cuda')})")
                skipped += 1
            elif (problem := compile_problem(block, where)) is not None:
                errors.append(problem)
            else:
                compiled += 1
        errors += undefined_names(doc, lines)
        n, problems = output_problems(lines, doc)
        outputs += n
        errors += problems
        errors += length_problems(doc, lines)
    for doc in docs + ["python/README.md"]:
        errors += link_problems(doc)
    for path, name in sorted(set(known) - shown):
        errors.append(f"{path}: excerpt {name} is shown in none of {', '.join(docs)} "
                      f"(<!-- snippet: {path} {name} -->)")
    for error in errors:
        print(f"readme: {error}", file=sys.stderr)
    if errors:
        return 1
    print(f"readme: {len(docs)} documents (README.md, docs/*.md): the {compiled + skipped} code blocks are "
          f"excerpts of examples/; {compiled} compile (C) or parse (Python) as printed, {skipped} not compiled "
          f"here; Python blocks import what they use; the {outputs} output block(s) are lines their program "
          f"prints; every relative link (and python/README.md's) leads to a file and heading; README.md is "
          f"at most {README_MAX_LINES} lines, no section of docs/ over {SECTION_MAX_LINES}")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args not in ([], ["--update"]):
        sys.exit(__doc__)
    sys.exit(main(update=args == ["--update"]))
