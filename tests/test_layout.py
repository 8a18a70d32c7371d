"""The package's folders are its map (fastpt/__init__.py): the layers that teach never import the shell,
imports between folders go one way (down the map's layer order, never in a cycle), and the run's order
lives in train.py alone."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fastpt"
SHELL = "fastpt.cli"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function, as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def teaching_modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "cli" not in p.relative_to(PACKAGE).parts and p.name != "__main__.py"]


def test_the_teaching_layers_never_import_the_shell():
    assert len(teaching_modules()) > 25
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.startswith(SHELL))
                 for p in teaching_modules()}
    assert not {k: v for k, v in offenders.items() if v}


def test_the_detector_sees_a_shell_import_inside_a_function(tmp_path):
    """A canary: a local import, as the lazy ones in fastpt are, is found too."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from fastpt.cli import shell\n    from fastpt.cli.args import parse_args\n")
    assert {"fastpt.cli.shell", "fastpt.cli.args"} <= imported_modules(module)


# The layers from the bottom up: a folder imports only folders below it. The ground is three modules at the
# package's top that every layer reads (config.py on config_rules.py, errors.py); cli/ is the shell on top.
GROUND = ["config_rules", "config", "errors"]
LAYERS = [*GROUND, "files", "cluster", "monitoring", "speedups", "inputs", "strategies", "loop", "cli"]


def folder_imports(package: Path) -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> the modules behind that edge, for every edge between two folders."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).parts
        if len(parts) < 2 and path.stem not in GROUND:
            continue
        parts = parts if len(parts) > 1 else (path.stem,)
        for module in imported_modules(path):
            names = module.split(".")
            if names[0] == package.name and len(names) > 1 and names[1] != parts[0]:
                edges.setdefault((parts[0], names[1]), []).append(f"{'/'.join(parts)} -> {module}")
    return edges


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """One cycle in a graph of names ([] if none), found by a depth-first walk."""
    done, path = set(), []

    def walk(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if cycle := walk(target):
                return cycle
        path.pop()
        done.add(node)
        return []

    for node in sorted(graph):
        if cycle := walk(node):
            return cycle
    return []


def folder_cycle(edges) -> list[str]:
    """One cycle among the folders ([] if none)."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    return cycle_in(graph)


def test_no_folder_imports_upward_or_in_a_cycle():
    edges = folder_imports(PACKAGE)
    assert edges, "the walk found no imports between folders"
    assert not folder_cycle(edges), f"folders import each other in a cycle: {' -> '.join(folder_cycle(edges))}"
    upward = {f"{s} -> {t}": v for (s, t), v in edges.items() if LAYERS.index(t) > LAYERS.index(s)}
    assert not upward, f"imports against the layer order {LAYERS}: {upward}"


def test_the_cycle_detector_sees_a_cycle_between_two_folders(tmp_path):
    """A canary: strategies/ importing loop/ while loop/ imports strategies/ (as before the config moved) fails."""
    package = tmp_path / "fastpt"
    for folder, imported in (("loop", "fastpt.strategies.base"), ("strategies", "fastpt.loop.config"),
                             ("files", "os")):
        (package / folder).mkdir(parents=True)
        (package / folder / "m.py").write_text(f"def f():\n    import {imported}\n")
    edges = folder_imports(package)
    assert set(edges) == {("loop", "strategies"), ("strategies", "loop")}
    assert folder_cycle(edges) in (["loop", "strategies", "loop"], ["strategies", "loop", "strategies"])
    assert folder_cycle({("loop", "strategies"): []}) == []


def test_every_module_sits_in_a_layer_folder():
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == sorted(GROUND), f"modules outside a layer folder: {loose}"
    layers = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert layers == sorted(set(LAYERS) - set(GROUND))
    described = (PACKAGE / "__init__.py").read_text()
    for layer in layers:
        assert f"{layer}/" in described, f"fastpt/__init__.py's map does not describe {layer}/"


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_no_two_files_import_each_other_in_a_circle():
    """Folders importing one way is not enough: two files of one folder can still import each other."""
    modules = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in imported_modules(path) if m in modules and m != name and not m.endswith("__init__")}
             for name, path in modules.items()}
    graph = {name: {t for t in targets if modules[t].name != "__init__.py"} for name, targets in graph.items()}
    cycle = cycle_in(graph)
    assert not cycle, f"files import each other in a circle: {' -> '.join(cycle)}"


def test_the_runs_order_lives_in_train_py_alone():
    """train.py calls the epoch loop, evaluation and the best checkpoint; nothing in the package does."""
    calls = {"train_epoch", "save_best", "load_best"}

    def called(path: Path) -> set[str]:
        return {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)}

    assert calls <= called(ROOT / "train.py")
    holders = {str(p.relative_to(ROOT)): sorted(calls & called(p)) for p in PACKAGE.rglob("*.py")}
    assert not {k: v for k, v in holders.items() if v}


def imported_names(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every `from fastpt.module import name` in a file."""
    return [(node.module, alias.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fastpt")
            for alias in node.names]


def test_no_private_name_crosses_a_module_and_errors_come_from_errors_py():
    """A `_name` is its module's own; an error class comes from errors.py, not through another module."""
    files = [*PACKAGE.rglob("*.py"), ROOT / "train.py", *(ROOT / "tests").glob("*.py")]
    private = {str(p.relative_to(ROOT)): [f"{m}.{n}" for m, n in imported_names(p) if n.startswith("_")]
               for p in files}
    assert not {k: v for k, v in private.items() if v}
    relayed = {str(p.relative_to(ROOT)): [f"{m}.{n}" for m, n in imported_names(p)
                                          if (n.endswith("Error") or n in ("NonFiniteLoss", "StopRequested"))
                                          and m != "fastpt.errors"] for p in files}
    assert not {k: v for k, v in relayed.items() if v}
