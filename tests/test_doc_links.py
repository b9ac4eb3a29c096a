"""Every relative link of README.md and docs/*.md reaches a file of the checkout, and every anchor a
heading of its page, as GitHub renders them (issue 43: two README links named a heading that was gone).
Every `.md` file a docstring, comment or page names is one the checkout has, and a `§N.M` after it a
heading of that page (issue 44: docstrings cited design documents outside the repository).
docs/architecture.md names every module of the package. Every backticked code name of the guide (the README and
docs/ but docs/evidence/) is one the code has (issue 54), and every evidence page says when and at which commits
it was recorded."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation other than '-' and '_' dropped,
    spaces as '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_slugs_are_githubs():
    assert slug("8. Served inside vLLM: stock vLLM 0.33.0 on the H200") == "8-served-inside-vllm-stock-vllm-0330-on-the-h200"
    assert slug("`serve --draft` and `doctor`") == "serve---draft-and-doctor"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(REPO) if REPO in dest.parents else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, broken


# A cited markdown file, optionally followed by a section: `docs/design/kernel-layouts.md §5.4`.
CITED = re.compile(r"(?<![\w.-])((?:\.{1,2}/|[\w-]+/)*[\w-]+\.md)\b(?:`?\)?\s+§(\d+(?:\.\d+)*))?")
SOURCES = [p for d in ("src", "tests", "bench", "tools") for p in sorted((REPO / d).rglob("*"))
           if p.suffix in (".py", ".sh") and p.is_file() and p != Path(__file__).resolve()]  # this file: examples


def cited_file(token: str, where: Path) -> Path | None:
    """The checkout's file a citation names: a path from the repository root, from the citing file's folder,
    or a page of docs/ or docs/evidence/ by its bare name (report.py renders links of docs/evidence/); None where
    the checkout has none."""
    for base in (REPO, where.parent, REPO / "docs", REPO / "docs" / "evidence"):
        path = (base / token).resolve()
        if path.is_file() and REPO in path.parents:
            return path
    return None


def citation_problems(path: Path) -> list[str]:
    text = LINK.sub(r"\1", path.read_text())  # a link's text is no citation; its target is (anchors: above)
    found = []
    for m in CITED.finditer(text):
        token, section = m.group(1), m.group(2)
        before, after = text[m.start() - 1:m.start()], text[m.end(1):m.end(1) + 1]
        if (any(part.rpartition(".")[0 if part.endswith(".md") else 2].isupper() for part in token.split("/"))
                or (before in "\"'" and before == after) or text[m.end(1):m.end(1) + 1] in ",)" and token == "args.md"):
            continue  # a placeholder (NOTES.md, SCRATCH/), a file name the code makes ("notes.md"), bench's args.md
        line = text.count("\n", 0, m.start()) + 1
        dest = cited_file(token, path)
        if dest is None:
            found.append(f"{path.relative_to(REPO)}:{line}: {token}: no such file in the checkout")
        elif section and not any(h.split("-")[0] == section.replace(".", "") for h in anchors(dest)):
            found.append(f"{path.relative_to(REPO)}:{line}: {token} §{section}: no such section")
    return found


def test_citation_pattern():
    hits = [(m.group(1), m.group(2)) for m in CITED.finditer(
        "see docs/design/kernel-layouts.md §5.4; `" + "kernel-layouts.md` §2.3 and (design/tensor-plan.md §3), cli.md")]
    assert hits == [("docs/design/kernel-layouts.md", "5.4"), ("kernel-layouts" + ".md", "2.3"),
                    ("design/tensor-plan.md", "3"), ("cli.md", None)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_cited_markdown_file_is_in_the_checkout(page):
    """A design document outside the repository (the project's own notes, say) is no
    help to a reader of a clone: cite the checkout's page (docs/design/) and its section."""
    assert not citation_problems(page)


def test_every_markdown_file_the_code_cites_is_in_the_checkout():
    """The same for every source file's docstrings and comments, in one test (one case per file was a fifth
    of the suite's test count)."""
    assert len(SOURCES) > 100
    assert {str(path.relative_to(REPO)): found for path in SOURCES if (found := citation_problems(path))} == {}


def test_architecture_names_every_module():
    """docs/architecture.md names each module of src/lucifer_shard/ (as `name.py` or `name/`)."""
    page = (REPO / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(REPO)) for p in sorted((REPO / "src" / "lucifer_shard").rglob("*.py"))
               if p.name != "__init__.py" and not re.search(rf"(?<![\w]){re.escape(p.name)}\b", page)]
    assert not missing, missing


# Code names in backticks (issue 54: the guide named `spec/plan.ARCHES` and `compat.SYMBOLS` long after they moved).
# The guide is the README and docs/ outside docs/evidence/: evidence pages are dated records whose code names are
# as of the commits they cite (docs/evidence/README.md), so they are exempt and carry a `Record:` line instead.
EVIDENCE = REPO / "docs" / "evidence"
GUIDE = [p for p in PAGES if EVIDENCE not in p.parents]
# Where the code lives, and the import prefix of each tree (src/lucifer_shard/ is the package lucifer_shard).
CODE_TREES = {"src/lucifer_shard": "lucifer_shard", "tools": "", "bench": "", "tests": ""}
ROOM_FOLDERS = {"formats", "model", "source", "output", "engine", "proof", "cli", "runtime_shim", "adapt", "load",
                "serving", "wrappers", "spec"}
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "sh", "toml", "txt", "yaml", "yml", "safetensors", "example", "env",
                 "log", "whl", "cfg", "lock", "partial"}
BACKTICKED = re.compile(r"`([^`\s]+)`")
DOTTED = re.compile(r"[A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)+")
CONSTANT = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
# Environment variables of the programs around the tool: a page names them, the code need not.
OTHERS_VARIABLES = ("VLLM_", "NCCL_", "GLOO_", "CUDA_", "TORCH_", "PYTORCH_", "HF_", "OMP_", "UCX_", "NVIDIA_")


def module_index() -> dict[str, list[Path]]:
    """Every name a doc may give a module by: its path from its tree (`model/plan`, `wrappers/policy`) or from the
    repository (`src/lucifer_shard/runtime_shim/adapt/compat`), dotted (`lucifer_shard.model.plan`), or its bare name (`compat`)."""
    index: dict[str, list[Path]] = {}
    for tree, prefix in CODE_TREES.items():
        for f in sorted((REPO / tree).rglob("*.py")):
            parts = list(f.relative_to(REPO / tree).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            keys = {sep.join(parts[i:]) for i in range(len(parts)) for sep in "/."}
            keys |= {sep.join([tree, *parts]) for sep in "/."}
            if prefix:
                keys.add(".".join([prefix, *parts]))
            for key in keys:
                index.setdefault(key, []).append(f)
    return index


def defined(body: list) -> dict[str, object]:
    """The names a module or class body binds: defs, classes, assignments, imports (in `if`/`try` blocks too)."""
    found: dict[str, object] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        for block in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and isinstance(
                    getattr(node, block, None), list):
                found.update(defined(getattr(node, block)))
    return found


def names_of(scope: ast.Module | ast.ClassDef) -> dict[str, object]:
    """A module's names, or a class's: its body's and the `self.x = ...` of its methods."""
    found = defined(scope.body)
    if isinstance(scope, ast.ClassDef):
        for node in ast.walk(scope):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and getattr(node.value, "id", "") == "self"):
                found.setdefault(node.attr, node)
    return found


class CodeNames:
    """Resolves a backticked code name against the checkout's sources by AST: nothing is imported (the runtime
    shim's modules import vLLM)."""

    def __init__(self):
        self.modules = module_index()
        self.sources = {f: f.read_text() for files in self.modules.values() for f in files}
        code = [p for t in CODE_TREES for p in (REPO / t).rglob("*.sh")] + [REPO / "Makefile"]
        self.words = set(re.findall(r"\w+", "\n".join(
            [*(s for f, s in self.sources.items() if f != Path(__file__).resolve()),
             *(p.read_text(errors="replace") for p in code)])))
        self.class_files: dict[str, list[Path]] = {}
        for f, text in self.sources.items():
            for name in re.findall(r"^class (\w+)", text, re.M):
                self.class_files.setdefault(name, []).append(f)
        self._trees: dict[Path, ast.Module] = {}

    def tree(self, f: Path) -> ast.Module:
        """`f` parsed, once: only the modules a page names are."""
        if f not in self._trees:
            self._trees[f] = ast.parse(self.sources[f])
        return self._trees[f]

    def classes(self, name: str) -> list[ast.ClassDef]:
        """The top-level classes called `name` in the checkout's code."""
        return [node for f in dict.fromkeys(self.class_files.get(name, []))
                for node in self.tree(f).body if isinstance(node, ast.ClassDef) and node.name == name]

    def problem(self, token: str) -> str | None:
        """Why `token` names no code of the checkout, or None (resolved, or not a name of this project's code)."""
        token = re.sub(r"\(.*\)$", "", token)
        if CONSTANT.fullmatch(token):
            if token in self.words or token.startswith(OTHERS_VARIABLES):
                return None  # named somewhere in the code: a definition, a variable it reads, a Makefile variable
            return f"no code of the checkout names {token}"
        if not DOTTED.fullmatch(token) or token.rpartition(".")[2] in FILE_SUFFIXES:
            return None
        parts = token.split(".")
        for cut in range(len(parts), 0, -1):
            key = ".".join(parts[:cut])
            if key in self.modules and cut == len(parts):
                return None  # the module itself: `lucifer_shard.model.layouts`
            if key in self.modules:
                attrs = parts[cut:]
                if cut == 1 and "/" not in key and not re.search(r"[A-Z_]", attrs[0]):
                    return None  # a bare `plan.axes` or `source.content`: a manifest field, not code
                if cut == 1 and all(f.name == "__init__.py" for f in self.modules[key]):
                    return None  # a bare room name before no module of it: `model.layers.0.ffn`, a tensor
                if any(self.resolves(self.tree(f), attrs) for f in self.modules[key]):
                    return None
                return f"{' or '.join(str(f.relative_to(REPO)) for f in self.modules[key])} defines no {'.'.join(attrs)}"
        if "/" in parts[0] and parts[0].split("/")[0] in {*CODE_TREES, "src", *ROOM_FOLDERS}:
            return f"no module {parts[0]}.py in the checkout"
        if classes := self.classes(parts[0]):
            if any(self.resolves(c, parts[1:]) for c in classes):
                return None
            return f"class {parts[0]} has no {'.'.join(parts[1:])}"
        return None  # vLLM's, torch's, a tensor or manifest field: not this project's code

    def resolves(self, scope: ast.Module | ast.ClassDef, attrs: list[str]) -> bool:
        node = names_of(scope).get(attrs[0])
        if node is None:
            return False
        if len(attrs) == 1 or not isinstance(node, ast.ClassDef):
            return True  # a function's, a value's or an import's attributes are not followed
        return self.resolves(node, attrs[1:])


def code_name_problems(page: Path, names: CodeNames) -> list[str]:
    """'PAGE:LINE: `name`: why' for each backticked name outside code blocks that names no code of the checkout."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())  # blank, keeping line numbers
    shown = page.relative_to(REPO) if REPO in page.parents else page.name
    found = []
    for m in BACKTICKED.finditer(text):
        why = names.problem(m.group(1))
        if why:
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{shown}:{line}: `{m.group(1)}`: {why} (name it as the code does now)")
    return found


@pytest.fixture(scope="module")
def code_names() -> CodeNames:
    return CodeNames()


@pytest.mark.parametrize("page", GUIDE, ids=lambda p: str(p.relative_to(REPO)))
def test_every_backticked_code_name_in_the_guide_resolves(page, code_names):
    assert not code_name_problems(page, code_names)


def test_a_stale_code_name_is_caught(tmp_path, code_names):
    """The names issue 54 found stale, planted in a page, are each reported; their live successors are not."""
    page = tmp_path / "stale.md"
    page.write_text("Add it to `model/plan.ARCHES` and `ARCH_CAPABILITY`, `model/layouts.ARCHS`, `compat.SYMBOLS`,\n"
                    "`layouts.same_kernel_layout`, `spec/nothere.X`, `Rule.nothere`. Live: `model/arches.ARCH_TABLE`,\n"
                    "`lucifer_shard.model.layouts`, `model/rules.RULES`, `Rule.pad`, `torch.cuda.is_available`, `config.json`.\n")
    found = code_name_problems(page, code_names)
    assert [f.split(": `")[1].split("`")[0] for f in found] == [
        "model/plan.ARCHES", "ARCH_CAPABILITY", "model/layouts.ARCHS", "compat.SYMBOLS", "layouts.same_kernel_layout",
        "spec/nothere.X", "Rule.nothere"], found
    assert found[0].startswith("stale.md:1: ") and found[-1].startswith("stale.md:2: ")


@pytest.mark.parametrize("page", [p for p in sorted(EVIDENCE.glob("*.md")) if p.name != "README.md"],
                         ids=lambda p: p.name)
def test_every_evidence_page_is_dated_and_cites_a_commit(page):
    """An evidence page's code names are as of its commits, so it says which: a `Record:` line before its first
    section with a date and a short commit hash (docs/evidence/README.md is the index, not a record)."""
    head = page.read_text().split("\n## ", 1)[0]
    record = next((line for line in head.splitlines() if line.startswith("Record: ")), "")
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", record) and re.search(r"\b[0-9a-f]{7,12}\b", record), page
