"""Every relative link of README.md and docs/*.md reaches a file of the checkout, and every anchor a
heading of its page, as GitHub renders them (issue 43: two README links named a heading that was gone).
Every `.md` file a docstring, comment or page names is one the checkout has, and a `§N.M` after it a
heading of that page (issue 44: docstrings cited design documents outside the repository).
docs/architecture.md names every module of the package."""
from __future__ import annotations

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
SOURCES = [p for d in ("converter", "runtime_shim", "tests", "bench", "tools") for p in sorted((REPO / d).rglob("*"))
           if p.suffix in (".py", ".sh") and p.is_file() and p != Path(__file__).resolve()]  # this file: examples


def cited_file(token: str, where: Path) -> Path | None:
    """The checkout's file a citation names: a path from the repository root, from the citing file's folder,
    or a page of docs/ by its bare name; None where the checkout has none."""
    for base in (REPO, where.parent, REPO / "docs"):
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


@pytest.mark.parametrize("path", [*PAGES, *SOURCES], ids=lambda p: str(p.relative_to(REPO)))
def test_every_cited_markdown_file_is_in_the_checkout(path):
    """A design document outside the repository (the project's own notes, say) is no
    help to a reader of a clone: cite the checkout's page (docs/design/) and its section."""
    assert not citation_problems(path)


def test_architecture_names_every_module():
    """docs/architecture.md names each module of converter/ and runtime_shim/ (as `name.py` or `name/`)."""
    page = (REPO / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(REPO)) for d in ("converter", "runtime_shim") for p in sorted((REPO / d).rglob("*.py"))
               if p.name != "__init__.py" and not re.search(rf"(?<![\w]){re.escape(p.name)}\b", page)]
    assert not missing, missing
