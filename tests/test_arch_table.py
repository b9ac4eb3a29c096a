"""The GPU-arch facts live in one table, src/lucifer_shard/model/arches.py: no other module of the converter or the shim
spells an --arch, a CUDA capability, a MoE variant or a backend name as a value (checked from the source with
`ast`; prose in messages and docstrings is not a value). The build table (model/runtimes.py) derives its columns
from this one; what it derives is pinned here."""
from __future__ import annotations

import ast
from pathlib import Path

from lucifer_shard.model import arches, runtimes

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "lucifer_shard"
TABLE = SRC / "model" / "arches.py"
FACTS = {*arches.ARCHES, *arches.MOE_VARIANT.values(), *(a.attention for a in arches.ARCH_TABLE),
         *(m for a in arches.ARCH_TABLE for m in a.moe_backends)}
CAPABILITIES = {a.capability for a in arches.ARCH_TABLE}


def copies(path: Path) -> list[str]:
    """'file:line value' for each arch fact `path` spells as a value: a string constant that is one, or a
    tuple of constants that is a capability."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FACTS:
            found.append(f"{path.name}:{node.lineno} {node.value!r}")
        elif isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts):
            value = tuple(e.value for e in node.elts)
            if value in CAPABILITIES:
                found.append(f"{path.name}:{node.lineno} {value!r}")
    return found


def test_the_arch_facts_live_only_in_the_arch_table():
    sources = sorted(set(SRC.rglob("*.py")) - {TABLE})
    assert len(sources) > 50
    assert [c for path in sources for c in copies(path)] == []


def test_the_check_finds_a_copy(tmp_path):
    path = tmp_path / "copy.py"
    path.write_text('"""sm90 in prose is fine."""\nARCH = "sm90"\nCAP = {"x": (12, 1)}\nBACKEND = ("marlin",)\n')
    assert copies(path) == ["copy.py:2 'sm90'", "copy.py:3 (12, 1)", "copy.py:4 'marlin'"]
    assert len(copies(TABLE)) > len(arches.ARCH_TABLE)


def test_fork_builds_names_the_fork_builds_of_supported_builds():
    forks = [b.commit for b in runtimes.SUPPORTED_BUILDS if not b.stock]
    assert forks and runtimes.FORK_BUILDS == f"mlow/vllm ({', '.join(forks)})"
    assert runtimes.REPOSITORY.endswith("/mlow/vllm")


def test_the_build_tables_kernel_columns_are_the_arch_tables_families():
    """The columns doctor and docs/serving.md print, derived from the arch table and the draft kinds."""
    assert (runtimes.FORK_TUPLE_KERNEL, runtimes.OTHER_KERNEL) == ("sm120/sm100 kernel", "sm90 kernel")
    assert runtimes.COLUMNS == ("TP3 (virtual TP)", "sm120/sm100 kernel", "model layout", "sm90 kernel", "MTP draft",
                                "DSpark draft")


def test_the_table_is_consistent():
    """Every step a row names is a layouts step; capabilities are distinct; a MoE route runs on some family."""
    from lucifer_shard.model.layouts import STEPS
    from lucifer_shard.model.plan import MOE_ROUTES

    assert {s for a in arches.ARCH_TABLE for g in a.kernel_steps.values() for ss in g.values() for s in ss} <= set(STEPS)
    assert len(CAPABILITIES) == len(arches.ARCH_TABLE)
    assert all(route.arches for route in MOE_ROUTES.values())
    assert [arches.family(a) for a in arches.ARCHES] == ["sm120", "sm120", "sm100", "sm90"]
