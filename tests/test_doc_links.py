"""Every relative link of README.md and docs/*.md reaches a file of the checkout, and every anchor a
heading of its page, as GitHub renders them (issue 43: two README links named a heading that was gone)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
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
