"""The architecture the tree draws (src/lucifer_shard/__init__.py), checked from the source with `ast`: every
import, absolute or relative, at module level or inside a function, of every module of `lucifer_shard`.
Folders are import names (src/lucifer_shard/ is `lucifer_shard`). The rooms are ordered: each imports only
the rooms below it, formats < model < source < output < engine | proof < cli, the engine and the proof
never each other; the runtime shim reuses the rooms up to proof/, never the engine or the commands, and
its own rooms are ordered too: its shared modules < adapt < load < serving, which only the CLI and the
plugin's register() import. No lazy import breaks a circle, and no module grows past 600 lines."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"lucifer_shard": REPO / "src" / "lucifer_shard"}
ROOMS = ("formats", "model", "source", "output", "engine", "proof", "cli")
SHIM_ROOMS = ("adapt", "load", "serving")
# "shared": errors.py, units.py, guarded_io.py, outnames.py and the package's __init__, below every room;
# "runtime_shim": the shim's own shared modules (errors, manifest, checks); "plugin": its __init__ (register()).
_BELOW = ("shared", "formats", "model", "source", "output")
ALLOWED = {
    "shared": {"shared"},
    "formats": {"shared", "formats"},
    "model": {"shared", "formats", "model"},
    "source": {*_BELOW[:3], "source"},
    "output": {*_BELOW},
    "engine": {*_BELOW, "engine"},
    "proof": {*_BELOW, "proof"},
    "cli": {*_BELOW, "engine", "proof", "cli", "plugin", "runtime_shim", *(f"runtime_shim.{r}" for r in SHIM_ROOMS)},
    "runtime_shim": {*_BELOW, "proof", "runtime_shim"},
    "runtime_shim.adapt": {*_BELOW, "proof", "runtime_shim", "runtime_shim.adapt"},
    "runtime_shim.load": {*_BELOW, "proof", "runtime_shim", "runtime_shim.adapt", "runtime_shim.load"},
    "runtime_shim.serving": {*_BELOW, "proof", "plugin", "runtime_shim", "runtime_shim.adapt", "runtime_shim.load",
                             "runtime_shim.serving"},
    "plugin": {*_BELOW, "proof", "plugin", "runtime_shim", *(f"runtime_shim.{r}" for r in SHIM_ROOMS)},
}
MAX_LINES = 600


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted name -> file of every module under each package's folder (a package is its __init__)."""
    out = {}
    for package, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _imports(name: str, path: Path, where: str = "anywhere") -> set[str]:
    """The dotted names a module imports (`where`: "anywhere", "module" (executed at import: the module's
    body, outside `if TYPE_CHECKING`) or "lazy" (the rest)), relative imports resolved; for `from X import y`
    both X and X.y (y may be a module: `from ..engine import diskspace`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    at_import = set()
    todo = list(tree.body)
    while todo:  # the statements run at import: the body, and the branches of its if/try (not TYPE_CHECKING's)
        node = todo.pop()
        at_import.add(id(node))
        if isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    found = set()
    for node in ast.walk(tree):
        if where != "anywhere" and (id(node) in at_import) != (where == "module"):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def imported(name: str, path: Path) -> set[str]:
    """Every dotted name a module imports, anywhere in its file."""
    return _imports(name, path)


def part_of(name: str) -> str | None:
    """The room of a dotted name ("shared", a room, "runtime_shim[.room]", "plugin"); None outside lucifer_shard."""
    parts = name.split(".")
    if parts[0] != "lucifer_shard":
        return None
    if len(parts) > 1 and parts[1] in ROOMS:
        return parts[1]
    if len(parts) > 1 and parts[1] == "runtime_shim":
        if len(parts) == 2 or parts[2] == "register":
            return "plugin"
        return f"runtime_shim.{parts[2]}" if parts[2] in SHIM_ROOMS else "runtime_shim"
    return "shared"


def _shown(path: Path, packages: dict[str, Path]) -> Path:
    root = next(r for r in packages.values() if r in path.parents or r == path.parent)
    return path.relative_to(root.parent.parent if root.parent.name == "src" else root.parent)


def violations(packages: dict[str, Path]) -> list[str]:
    """One line per import a room may not make (the outermost name it reaches) and per module past MAX_LINES."""
    found = []
    for name, path in modules(packages).items():
        shown = _shown(path, packages)
        own = part_of(name)
        bad = {target for target in imported(name, path) if part_of(target) not in (None, *ALLOWED[own])}
        found += [f"{shown} ({own}) imports {target}" for target in sorted(bad)
                  if target.rpartition(".")[0] not in bad]
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            found.append(f"{shown}: {lines} lines, more than {MAX_LINES}")
    return found


def import_style(packages: dict[str, Path]) -> list[str]:
    """One line per import spelled against the rule: the converter (every room but the shim) imports the
    package relatively and never names `lucifer_shard`; the runtime shim imports its own modules relatively
    and names the converter only as `lucifer_shard.*`, so every crossing of the shim's boundary reads as one."""
    found = []
    shim = "lucifer_shard.runtime_shim"
    for name, path in modules(packages).items():
        in_shim = name == shim or name.startswith(shim + ".")
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*anchor, *([node.module] if node.module else [])])
                if in_shim and not (target == shim or target.startswith(shim + ".")):
                    found.append(f"{path.name}: imports {target} relatively (the converter: lucifer_shard.*)")
                continue
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for target in names:
                if target.split(".")[0] != "lucifer_shard":
                    continue
                if not in_shim or target == shim or target.startswith(shim + "."):
                    found.append(f"{path.name}: imports {target} absolutely (its own folder: relatively)")
    return found


# A lazy import (inside a function, or for type checking) that would close a circle at module level is a
# layering fault hidden: a fact sits in the wrong room. The exceptions, each with its reason:
LAZY_EXEMPT = {
    "lucifer_shard.runtime_shim": "the plugin's entry point: vLLM imports it in every process; register() imports "
                                  "what it installs only when it runs",
}


def _module_of(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _with_packages(name: str, importer: str) -> set[str]:
    """A module and the packages Python imports first to reach it, but the importer's own packages (they
    are always imported before it)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - _with_packages(importer, "") if importer else \
        {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def route(graph: dict[str, list[str]], start: str, goal: str) -> list[str] | None:
    """A shortest route from `start` to `goal` in an import graph (breadth first), or None."""
    todo, came = [start], {start: None}
    while todo:
        node = todo.pop(0)
        if node == goal:
            found = [node]
            while came[found[-1]] is not None:
                found.append(came[found[-1]])
            return found[::-1]
        for nxt in graph[node]:
            if nxt not in came:
                came[nxt] = node
                todo.append(nxt)
    return None


def lazy_circles(packages: dict[str, Path]) -> list[str]:
    """'a imports b lazily: b imports a at module level (b -> ... -> a)' for each lazy import that breaks a circle."""
    mods = modules(packages)
    graph = {n: sorted({m for t in _imports(n, p, "module") if (mod := _module_of(t, mods))
                        for m in _with_packages(mod, n) if m in mods and m != n}) for n, p in mods.items()}

    found = []
    for name, path in mods.items():
        if name in LAZY_EXEMPT:
            continue
        targets = {mod for t in _imports(name, path, "lazy") if (mod := _module_of(t, mods)) and mod != name}
        for target in sorted(targets):
            back = route(graph, target, name)
            if back:
                found.append(f"{name} imports {target} lazily: {' -> '.join(back)}")
    return found


def test_imports_are_relative_inside_the_converter_and_absolute_across_the_shims_boundary():
    assert import_style(PACKAGES) == []


def test_the_import_style_check_finds_each_kind(tmp_path):
    root = tmp_path / "src" / "lucifer_shard"
    shim = root / "runtime_shim"
    (root / "model").mkdir(parents=True)
    shim.mkdir()
    (root / "model" / "a.py").write_text("from lucifer_shard.model import b\n")
    (shim / "x.py").write_text("from ..model import rules\nfrom lucifer_shard.runtime_shim import y\n")
    (shim / "ok.py").write_text("from . import y\nfrom lucifer_shard.model import rules\n")
    found = import_style({"lucifer_shard": root})
    assert found == ["a.py: imports lucifer_shard.model absolutely (its own folder: relatively)",
                     "x.py: imports lucifer_shard.model relatively (the converter: lucifer_shard.*)",
                     "x.py: imports lucifer_shard.runtime_shim absolutely (its own folder: relatively)"], found


def test_every_room_imports_only_what_it_may():
    assert violations(PACKAGES) == []


def test_no_lazy_import_breaks_a_circle():
    assert lazy_circles(PACKAGES) == []


def test_the_lazy_import_check_finds_a_circle(tmp_path):
    root = tmp_path / "src" / "lucifer_shard"
    (root / "model").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "model" / "__init__.py").write_text("")
    (root / "model" / "config.py").write_text("def f():\n    from .v41 import refusal\n")
    (root / "model" / "v41.py").write_text("from .plan import x\n")
    (root / "model" / "plan.py").write_text("from typing import TYPE_CHECKING\nfrom .config import y\n"
                                            "if TYPE_CHECKING:\n    from .v41 import z\n")
    assert lazy_circles({"lucifer_shard": root}) == [
        "lucifer_shard.model.config imports lucifer_shard.model.v41 lazily: lucifer_shard.model.v41 -> "
        "lucifer_shard.model.plan -> lucifer_shard.model.config",
        "lucifer_shard.model.plan imports lucifer_shard.model.v41 lazily: lucifer_shard.model.v41 -> "
        "lucifer_shard.model.plan"]


def test_the_check_reads_every_room():
    """Not vacuous: the tree has every room, the shim's, and modules that import across them."""
    found = modules(PACKAGES)
    assert {part_of(n) for n in found} == {*ROOMS, "shared", "plugin", "runtime_shim",
                                           *(f"runtime_shim.{r}" for r in SHIM_ROOMS)}
    # a relative import inside a function, an absolute one at module level
    assert "lucifer_shard.engine.convert" in imported("lucifer_shard.cli.group", found["lucifer_shard.cli.group"])
    plan = "lucifer_shard.runtime_shim.load.loadplan"
    assert "lucifer_shard.model.runtimes" in imported(plan, found[plan])


def test_a_forbidden_import_is_found_wherever_it_is(tmp_path):
    """Relative and absolute imports, at module level and inside functions, and a module past the limit."""
    root = tmp_path / "src" / "lucifer_shard"
    for room in ROOMS:
        (root / room).mkdir(parents=True)
        (root / room / "__init__.py").write_text("")
    (root / "__init__.py").write_text("from .engine import convert\n")
    (root / "model" / "plan.py").write_text("def f():\n    from ..proof.diff import diff\n")
    (root / "formats" / "schema.py").write_text("from ..model import config\n")
    (root / "source" / "hub.py").write_text("from ..output.manifest import X\n")
    (root / "engine" / "convert.py").write_text("import lucifer_shard.cli.group\nfrom .. import proof\n")
    (root / "proof" / "verify.py").write_text("from ..model import rules\n" + "x = 1\n" * MAX_LINES)
    (root / "cli" / "group.py").write_text("from ..engine.convert import convert\nfrom ..proof import diff\n"
                                           "from ..runtime_shim.serving import doctor\n")
    shim = root / "runtime_shim"
    for room in SHIM_ROOMS:
        (shim / room).mkdir(parents=True)
    (shim / "load" / "loader.py").write_text("def load():\n    from lucifer_shard.engine.stwriter import file_digest\n"
                                             "from ..serving import doctor\n")
    (shim / "adapt" / "compat.py").write_text("from ..load import loadplan\n")
    (shim / "serving" / "doctor.py").write_text("from ..load import nodefiles\nfrom .. import register\n")
    got = violations({"lucifer_shard": root})
    assert got == [
        "src/lucifer_shard/__init__.py (shared) imports lucifer_shard.engine",
        "src/lucifer_shard/engine/convert.py (engine) imports lucifer_shard.cli.group",
        "src/lucifer_shard/engine/convert.py (engine) imports lucifer_shard.proof",
        "src/lucifer_shard/formats/schema.py (formats) imports lucifer_shard.model",
        "src/lucifer_shard/model/plan.py (model) imports lucifer_shard.proof.diff",
        f"src/lucifer_shard/proof/verify.py: {MAX_LINES + 1} lines, more than {MAX_LINES}",
        "src/lucifer_shard/runtime_shim/adapt/compat.py (runtime_shim.adapt) imports lucifer_shard.runtime_shim.load",
        "src/lucifer_shard/runtime_shim/load/loader.py (runtime_shim.load) imports lucifer_shard.engine.stwriter",
        "src/lucifer_shard/runtime_shim/load/loader.py (runtime_shim.load) imports lucifer_shard.runtime_shim.serving",
        "src/lucifer_shard/source/hub.py (source) imports lucifer_shard.output.manifest",
    ], got


# Inside the runtime shim: vLLM at module level only where a vLLM class is subclassed (the loader),
# so that doctor and `serve --dry-run` import on a machine without vLLM. The one table of builds is
# model/runtimes.py (no other module of either package defines a build row); compat.py, the judge the
# wrapper files import, imports no other shim module; and no two shim modules import each other, by
# any path (a package's __init__ aside: `from . import x` names the package too).
SHIM_VLLM_AT_IMPORT = {"lucifer_shard.runtime_shim.load.loader"}
BUILD_TABLE = "lucifer_shard.model.runtimes"
SHIM_JUDGE = "lucifer_shard.runtime_shim.adapt.compat"


def module_level_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
    return found


def import_circles(mods: dict[str, Path]) -> list[str]:
    """'a -> b -> a' for each pair of shim modules that reach each other through imports (anywhere in a file)."""
    shim = {n: p for n, p in mods.items() if n.startswith("lucifer_shard.runtime_shim")}
    packages = {n for n, p in shim.items() if p.name == "__init__.py"}
    graph = {n: sorted(m for m in imported(n, p) if m in shim and m not in packages and m != n) for n, p in shim.items()}

    return [" -> ".join([a, *back]) for a in sorted(graph) for b in graph[a] if (back := route(graph, b, a)) and a < b]


def shim_problems(mods: dict[str, Path]) -> list[str]:
    problems = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        builds = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Build"]
        if builds and name != BUILD_TABLE:
            problems.append(f"{name} defines vLLM builds (line {builds[0].lineno}); the table is {BUILD_TABLE}")
        if not name.startswith("lucifer_shard.runtime_shim"):
            continue
        at_import = {m for m in module_level_imports(path) if m.split(".")[0] == "vllm"}
        if at_import and name not in SHIM_VLLM_AT_IMPORT:
            problems.append(f"{name} imports {sorted(at_import)} at module level")
    judge = {m for m in imported(SHIM_JUDGE, mods[SHIM_JUDGE]) if m.startswith("lucifer_shard.runtime_shim")}
    if judge:
        problems.append(f"{SHIM_JUDGE} imports {sorted(judge)}")
    return problems + [f"import circle: {c}" for c in import_circles(mods)]


def test_the_shim_keeps_vllm_lazy_its_build_table_in_one_place_and_no_import_circle():
    assert shim_problems(modules(PACKAGES)) == []


def test_the_shim_check_finds_each_kind(tmp_path):
    root = tmp_path / "runtime_shim"
    (root / "adapt").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "adapt" / "__init__.py").write_text("")
    (root / "adapt" / "compat.py").write_text("from .. import patches\nB = 1\n")
    (root / "patches.py").write_text("import vllm.config\nX = Build('1.0', 'x', {}, True, '', ())\n"
                                     "def f():\n    from .adapt import stock_vtp\n")
    (root / "adapt" / "stock_vtp.py").write_text("from ..patches import X\n")
    (root / "load").mkdir()
    (root / "load" / "loader.py").write_text("from vllm.model_executor import model_loader\n")
    found = shim_problems(modules({"lucifer_shard.runtime_shim": root}))
    assert found == ["lucifer_shard.runtime_shim.patches defines vLLM builds (line 2); the table is "
                     "lucifer_shard.model.runtimes",
                     "lucifer_shard.runtime_shim.patches imports ['vllm.config'] at module level",
                     "lucifer_shard.runtime_shim.adapt.compat imports ['lucifer_shard.runtime_shim', "
                     "'lucifer_shard.runtime_shim.patches']",
                     "import circle: lucifer_shard.runtime_shim.adapt.stock_vtp -> lucifer_shard.runtime_shim.patches "
                     "-> lucifer_shard.runtime_shim.adapt.stock_vtp"], found


# File I/O goes through lucifer_shard.guarded_io (issue 26): no other module opens, deletes or
# renames a file itself. A primitive is a call of one of these; `.replace(x)` with one argument is
# Path.replace (str.replace takes two). A method of the guarded helpers' `Tree` (its receiver is
# `Tree(...)`, or a name or attribute called `tree`) is the helper itself, not a primitive.
GUARDED = "lucifer_shard.guarded_io"
IO_CALLS = {"open", "safe_open", "save_file"}
IO_MODULE_CALLS = {"os": {"open", "unlink", "remove", "rmdir", "removedirs", "rename", "renames", "replace",
                          "truncate", "mkfifo", "mknod"},
                   "shutil": {"rmtree", "copy", "copy2", "copyfile", "copytree", "move"}}
IO_METHODS = {"unlink", "rmdir", "rename", "read_text", "write_text", "read_bytes", "write_bytes", "touch", "open"}
# (module, call as reported) -> why it is not a file of a user, a model or an output.
IO_EXEMPT = {
    ("lucifer_shard.engine.presets", "read_text"): "a preset config shipped inside the package",
    ("lucifer_shard.engine.job", "footprint.read_bytes"): "arithmetic: the bytes a plan reads",
    ("lucifer_shard.cli.console", "os.open"): "os.devnull, in place of a stdout that was closed",
    ("lucifer_shard.proof.outdir", "safe_open"): "/proc/self/fd/N of a rank file opened by Tree.open_read",
}


def _is_tree(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id == "Tree"
    return (isinstance(node, ast.Name) and node.id == "tree") or (isinstance(node, ast.Attribute)
                                                                   and node.attr == "tree")


def io_calls(path: Path) -> list[tuple[int, str]]:
    """(line, primitive) of every file-I/O primitive called in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in IO_CALLS:
            found.append((node.lineno, f.id))
        elif isinstance(f, ast.Attribute):
            owner = f.value.id if isinstance(f.value, ast.Name) else None
            if owner in IO_MODULE_CALLS:
                if f.attr in IO_MODULE_CALLS[owner]:
                    found.append((node.lineno, f"{owner}.{f.attr}"))
            elif _is_tree(f.value):
                continue
            elif f.attr in IO_METHODS or (f.attr == "replace" and len(node.args) == 1 and not node.keywords):
                found.append((node.lineno, f"{owner}.{f.attr}" if owner else f.attr))
    return found


def unguarded_io(packages: dict[str, Path]) -> list[str]:
    found = []
    for name, path in modules(packages).items():
        if name == GUARDED:
            continue
        shown = _shown(path, packages)
        found += [f"{shown}:{line} calls {call}" for line, call in io_calls(path) if (name, call) not in IO_EXEMPT]
    return found


def test_file_io_goes_through_the_guarded_helpers():
    assert unguarded_io(PACKAGES) == []


def test_the_io_check_finds_each_primitive(tmp_path):
    root = tmp_path / "src" / "lucifer_shard"
    (root / "engine").mkdir(parents=True)
    (root / "guarded_io.py").write_text("import os\nos.unlink('x')\n")
    (root / "engine" / "bad.py").write_text(
        "import os, shutil\nfrom pathlib import Path\nopen('a')\nos.open('b', 0)\nshutil.rmtree('c')\n"
        "Path('d').unlink()\nPath('e').replace(Path('f'))\n'g'.replace('h', 'i')\nPath('j').write_text('k')\n"
        "os.replace('l', 'm')\ntree.write_bytes('n', b'')\nTree(o).remove('p')\npath.read_bytes()\n")
    assert unguarded_io({"lucifer_shard": root}) == [
        "src/lucifer_shard/engine/bad.py:3 calls open", "src/lucifer_shard/engine/bad.py:4 calls os.open",
        "src/lucifer_shard/engine/bad.py:5 calls shutil.rmtree", "src/lucifer_shard/engine/bad.py:6 calls unlink",
        "src/lucifer_shard/engine/bad.py:7 calls replace", "src/lucifer_shard/engine/bad.py:9 calls write_text",
        "src/lucifer_shard/engine/bad.py:10 calls os.replace", "src/lucifer_shard/engine/bad.py:13 calls path.read_bytes"]
