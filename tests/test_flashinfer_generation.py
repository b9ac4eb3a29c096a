"""Which sm90 layout generation an installed FlashInfer reads (`model/runtimes.flashinfer_generation`, read off
the one table FLASHINFER_VERSIONS) and what serving sm90 kernel-layout files on the other one is told
(`flashinfer_problem`, which doctor and the loader report): docs/design/kernel-layouts.md §1."""
from __future__ import annotations

import pytest

from lucifer_shard.model import runtimes
from lucifer_shard.model.runtimes import FLASHINFER_VERSIONS, flashinfer_generation, flashinfer_problem


@pytest.mark.parametrize("version,generation", [
    ("0.6.9", None), ("0.6.10", "legacy"), ("0.6.12", "legacy"), ("0.6.15", "legacy"), ("0.6.15.post1", "legacy"),
    ("0.6.16", "folded"), ("0.6.17", "legacy"), ("0.6.18", "folded"), ("0.6.30", "folded"), ("0.7.0", "folded"),
    ("0.7.2.post1", "folded"), ("0.7.4", "folded"), ("0.8.0rc1", "folded"), ("0.5.3", None), ("", None),
    ("unknown", None)])
def test_versions_map_to_the_generation_the_table_gives(version, generation):
    assert flashinfer_generation(version) == generation


def test_every_version_the_table_names_maps_to_its_own_generation():
    """The table's own endpoints, parsed the way a reader of --flashinfer-layout's help would."""
    for generation, items in FLASHINFER_VERSIONS.items():
        for item in items.split(", "):
            ends = item.removeprefix(">=").replace(".x", ".0").split("-")
            assert all(flashinfer_generation(v) == generation for v in ends), (generation, item)


def test_the_builds_pins_read_the_generation_their_files_are_written_in():
    """The vetted stock releases pin a folded FlashInfer (the default --flashinfer-layout); the mlow/vllm
    forks pin legacy ones; the CPU build has none."""
    for b in runtimes.SUPPORTED_BUILDS:
        want = None if b.flashinfer == "none" else "folded" if runtimes.STOCK_CONFIG in b.wrappers else "legacy"
        assert flashinfer_generation(b.flashinfer) == want, b.commit


def test_problem_names_both_generations_and_both_fixes():
    assert flashinfer_problem(None, None) is None and flashinfer_problem(None, "0.6.13") is None
    assert flashinfer_problem("folded", "0.7.2.post1") is None and flashinfer_problem("legacy", "0.6.17") is None
    why, fix = flashinfer_problem("legacy", "0.7.3")
    assert why == ("the routed experts are in FlashInfer's legacy sm90 layout (flashinfer-python 0.6.10-0.6.15, "
                   "0.6.17), but the installed flashinfer-python 0.7.3 reads the folded layout: its MoE kernel would "
                   "compute wrong numbers from these files")
    assert fix == "re-convert with --flashinfer-layout folded, or install flashinfer-python 0.6.10-0.6.15, 0.6.17"
    why, fix = flashinfer_problem("folded", "0.5.3")
    assert "0.5.3 is of no sm90 layout generation this tool knows: its MoE kernel may" in why
    assert fix == "install flashinfer-python 0.6.16, >=0.6.18, 0.7.x"
    why, fix = flashinfer_problem("folded", None)
    assert why.endswith("and flashinfer-python is not installed") and fix.startswith("install flashinfer-python 0.6.16")
