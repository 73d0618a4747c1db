"""The package's structure (ARCHITECTURE.md): imports inside python/vmmipc
follow the layers ARCHITECTURE.md draws (read from the document, so the two
cannot drift; counting imports inside functions too), no module reads
another module's private names, `_mp` knows no vmmipc type, one module
touches copyreg and ForkingPickler, and the handle-type names are the Go
table's. Read from the source, so it needs no library."""

import ast
import os
import re

import conftest

PACKAGE_DIR = os.path.join(conftest.PYTHON_DIR, "vmmipc")
PACKAGE = "vmmipc"


def modules() -> dict[str, ast.Module]:
    out = {}
    for name in sorted(os.listdir(PACKAGE_DIR)):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE_DIR, name)) as f:
                out[name[:-3]] = ast.parse(f.read(), name)
    return out


def imported_names(tree: ast.Module, known: set[str]) -> set[tuple[str, str]]:
    """(module, name) for every name taken from a sibling module, anywhere in
    the file (module level and inside functions); name "" for the module
    itself."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or node.module == PACKAGE or (node.module or "").startswith(
                    PACKAGE + "."):
                base = node.module if node.level == 1 else (
                    node.module[len(PACKAGE) + 1:] if node.module != PACKAGE else None)
                for alias in node.names:
                    if base is None:  # from . import x: x is a module, or __init__'s
                        out.add((alias.name, "") if alias.name in known else ("__init__",
                                                                               alias.name))
                    else:
                        out.add((base, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    out.add((alias.name.split(".")[1], ""))
                elif alias.name == PACKAGE:
                    out.add(("__init__", ""))
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m, _ in imported_names(tree, set(mods))} - {name}
            for name, tree in mods.items()}


def find_cycle(graph: dict[str, set[str]]):
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_import_reader_sees_function_level_imports():
    tree = ast.parse("def f():\n    from ._host import HostBuffer\n    from . import _lib\n")
    assert imported_names(tree, {"_host", "_lib"}) == {("_host", "HostBuffer"), ("_lib", "")}


def test_no_import_cycle():
    # __init__ is a node like the others: it imports the core modules, and a
    # framework adapter may use the public API through it (import vmmipc),
    # which is a cycle only if __init__ imports that adapter.
    graph = import_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_mp_knows_no_vmmipc_type():
    assert import_graph()["_mp"] <= {"_errors"}


def test_no_private_names_across_modules():
    mods = modules()
    known = set(mods)
    bad = [(name, m, n) for name, tree in mods.items()
           for m, n in imported_names(tree, known) if n.startswith("_")]
    for name, tree in mods.items():
        aliases = {a.asname or a.name for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None
                   for a in node.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")):
                bad.append((name, node.value.id, node.attr))
    assert not bad, f"private names read across modules: {bad}"


def test_one_module_installs_reducers():
    installers = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in ("register", "pickle")
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("ForkingPickler", "copyreg")):
                installers.append(name)
    assert set(installers) == {"_reductions"}, installers


ARCHITECTURE = os.path.join(conftest.ROOT, "ARCHITECTURE.md")


def drawn_layers(text: str) -> dict[str, int]:
    """module -> layer, from the first ```text block after the heading
    "### Python import layers" of ARCHITECTURE.md."""
    section = text.split("### Python import layers", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    layers = {}
    for line in block.splitlines():
        number, *names = line.split()
        for name in names:
            assert name not in layers, f"{name} drawn twice"
            layers[name] = int(number)
    return layers


def layer_violations(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    bad = [f"{m} is not drawn in ARCHITECTURE.md's layers" for m in sorted(graph) if m not in layers]
    bad += [f"{m} is drawn but is no module" for m in sorted(layers) if m not in graph]
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if m in layers and d in layers and layers[d] >= layers[m]:
                bad.append(f"{m} (layer {layers[m]}) imports {d} (layer {layers[d]})")
    return bad


def test_the_layer_checker_finds_upward_imports():
    layers = drawn_layers("### Python import layers\n\n```text\n0  a\n1  b  c\n```\n")
    assert layers == {"a": 0, "b": 1, "c": 1}
    assert layer_violations({"a": set(), "b": {"a"}, "c": set()}, layers) == []
    assert layer_violations({"a": {"b"}, "b": {"c"}, "c": set(), "d": set()}, layers) == [
        "d is not drawn in ARCHITECTURE.md's layers", "a (layer 0) imports b (layer 1)",
        "b (layer 1) imports c (layer 1)"]


def test_imports_follow_the_drawn_layers():
    with open(ARCHITECTURE) as f:
        layers = drawn_layers(f.read())
    bad = layer_violations(import_graph(), layers)
    assert not bad, "ARCHITECTURE.md's Python import layers and the code disagree:\n" + "\n".join(bad)


def test_only_torch_imports_its_halves():
    graph = import_graph()
    bad = [(m, d) for m, deps in graph.items() for d in deps
           if d.startswith("_torch_") and not (m == "torch" or m.startswith("_torch_"))]
    assert not bad, bad


def test_torchs_sender_and_receiver_state_never_import_each_other():
    # torch.multiprocessing.reductions' shape: each reduce_X beside its
    # rebuild_X (_torch_reductions), which uses both sides; neither side
    # uses the other (the layers alone would allow _torch_batch to).
    graph = import_graph()
    sender, receiver = {"_torch_runs", "_torch_batch"}, {"_torch_received"}
    bad = [(m, d) for m in sender for d in graph[m] if d in receiver]
    bad += [(m, d) for m in receiver for d in graph[m] if d in sender]
    assert not bad, bad


def test_one_module_wraps_forking_pickler_dump():
    writers = [name for name, tree in modules().items() for node in ast.walk(tree)
               if isinstance(node, ast.Assign) for t in node.targets
               if isinstance(t, ast.Attribute) and t.attr == "dump"
               and isinstance(t.value, ast.Name) and t.value.id == "ForkingPickler"]
    assert writers == ["_reductions"], writers


def test_handle_type_names_are_the_go_tables():
    import importlib
    go = open(os.path.join(conftest.ROOT, "cuda", "handletypes.go")).read()
    consts = {name: int(value, 16) for name, value in
              re.findall(r"^\s*(handle\w+)\s*=\s*(0x[0-9a-fA-F]+)", go, re.M)}
    table = {consts[c]: name for c, name in re.findall(r'\{(handle\w+), "(CU_MEM_HANDLE_TYPE_\w+)"\}', go)}
    assert len(table) == 4, go
    env = importlib.import_module("vmmipc._torch_env")
    assert env.HANDLE_TYPE_NAMES == table
    assert env.POSIX_FD_HANDLE == consts["handlePOSIXFD"]
