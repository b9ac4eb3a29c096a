"""OUT/README.md: the Hub model card convert writes, so that OUT uploaded as it is (without `.lucifer/`) is a
model repo that says what it holds and how each node fetches and serves its share.

Its front matter is huggingface_hub's (`ModelCardData`, rendered by `ModelCard`): tags, `base_model` (the
source repo id, when the manifest records one: a local checkpoint's folder name is not a repo id, and the
Hub would show a broken link) and `license` (from the source's own README.md front matter, when it has
one; else left out rather than guessed). The body is made from the manifest alone (conversion id, TP size,
layout, bytes per node) and the source's license, so the same conversion writes the same card, and a
repair writes it again byte for byte. The manifest records it among its `copies`: verify, stage, serve's
preflight and fetch check it like config.json.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..guarded_io import JSON_LIMIT, Tree, read_regular
from ..output.manifest import CARD_NAME, manifest_text
from ..output.manifest_types import Copy, Manifest
from ..output.share import node_ranks
from ..units import size
from .job import Job
from .journal import JournalEntry
from .manifest_writer import build_manifest

REPO = "REPO"  # the repo OUT is uploaded to, unknown when convert writes the card
LICENSE_KEYS = ("license", "license_name", "license_link")  # license_name and link go with license: other


def write_card(out: Path, job: Job, files: dict[str, JournalEntry]) -> None:
    """Write OUT/README.md for `job` with these rank files (convert: after the rank files, before the manifest)."""
    Tree(out).write_bytes(CARD_NAME, card_text(build_manifest(job, files), job_license(job)).encode())


def planned_sizes(job: Job, files: dict[str, JournalEntry]) -> list[int]:
    """The bytes of the card and of the manifest that records it, exact before anything is written (`files`:
    the planned rank files, whose digests have their fixed length): convert's room check counts both."""
    manifest = build_manifest(job, files)
    card = card_text(manifest, job_license(job)).encode()
    recorded = replace(manifest, copies={**manifest.copies, CARD_NAME: Copy(len(card), "blake3:" + "0" * 64)})
    return [len(card), len(manifest_text(recorded.to_dict()).encode())]


def card_text(manifest: Manifest, license: dict[str, str]) -> str:
    """The card of the output `manifest` describes, with the source's `license` fields (`job_license`)."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(base_model=manifest.source.repo, tags=["lucifer-shard", "deepseek_v4",
                                                                f"tensor-parallel-{manifest.tp_size}", "safetensors"],
                         **license)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{_body(manifest)}"))


def job_license(job: Job) -> dict[str, str]:
    """The license fields of the source's card: as the Hub publishes them for a repo id (its repo info's
    card data: no README downloaded), else from the checkpoint directory's README.md."""
    hub = job.ckpt.hub
    if hub is not None:
        return {k: str(hub.card[k]) for k in LICENSE_KEYS if hub.card.get(k)} if hub.card.get("license") else {}
    return source_license(job.ckpt.root)


def source_license(root: Path) -> dict[str, str]:
    """The license fields of the source's README.md front matter ({} without one)."""
    import yaml  # huggingface_hub's own dependency, which parses card front matter with it
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    readme = Path(root) / CARD_NAME
    if not readme.is_file():
        return {}
    text = read_regular(readme, JSON_LIMIT, follow=True).decode("utf-8", "replace")  # a cache's link to its blob
    block = REGEX_YAML_BLOCK.search(text)
    try:
        meta = yaml.safe_load(block.group(2)) if block else None
    except yaml.YAMLError:  # front matter the Hub could not read either: no license to carry over
        meta = None
    if not isinstance(meta, dict) or not meta.get("license"):
        return {}
    return {k: str(meta[k]) for k in LICENSE_KEYS if meta.get(k)}


def _body(m: Manifest) -> str:
    tp = m.tp_size
    source = f"`{m.source.repo}` at `{m.source.revision}`" if m.source.repo else "a local checkpoint"
    arch = f"{m.arch} (MoE variant {m.moe_variant})" if m.arch else "any GPU family (model layout)"
    shared = sum(c.bytes for name, c in m.copies.items() if name != CARD_NAME)  # as when the card was first written
    lines = [
        f"# {m.source.repo.split('/')[-1] if m.source.repo else 'DeepSeek-V4'} at tensor-parallel size {tp} "
        f"(lucifer-shard)", "",
        f"Per-rank safetensors of {source} for vLLM at TP {tp}, written by lucifer-shard {m.tool_version}: each "
        f"rank's files are loaded verbatim by the `lucifer_tp3` loader, and `lucifer-shard diff` proves them "
        f"against the source byte for byte.", "",
        "| | |", "| --- | --- |",
        f"| conversion id | `{m.conversion_id}` |",
        f"| TP size | {tp} |",
        f"| expert layout | {m.expert_layout} |",
        f"| arch | {arch} |",
        f"| draft | {m.draft.kind if m.draft else ('mtp' if 'draft' in m.roles else 'none')} |",
        f"| rank files | {size(sum(f.bytes for _, _, f in m.files()))} in all |", "",
        "## Bytes per node", "",
        "Each node needs only the rank files of the TP ranks it runs (target and draft), plus "
        f"`lucifer-manifest.json`, `config.json` and the tokenizer files ({size(shared)}) and this card.", "",
        "| nodes | node | TP ranks | rank files |", "| --- | --- | --- | --- |",
    ]
    for nnodes in (n for n in range(1, tp + 1) if tp % n == 0):
        for node in range(nnodes):
            ranks = node_ranks(tp, nnodes, node)
            lines.append(f"| {nnodes} | {node} | {', '.join(map(str, ranks))} | "
                         f"{size(sum(f.bytes for _, _, f in m.files(ranks)))} |")
    draft = " --draft" if "draft" in m.roles else ""  # serve with the draft this output holds
    lines += ["", "## Fetch and serve", "",
              "`lucifer-shard` is on no package index: build its wheel from its source repository (`make wheel`) "
              "and install it into the serving environment after vLLM (`pip install --no-deps`: vLLM brings its "
              "dependencies).", "",
              f"On node R of {tp} (`{REPO}` is this repository's id), fetch only that node's files, each checked "
              "against the manifest, then serve them:", "", "```"]
    for node in range(tp):
        lines += [f"lucifer-shard fetch {REPO} DEST --nnodes {tp} --node-rank {node}",
                  f"lucifer-shard serve DEST{draft} --nnodes {tp} --node-rank {node} --master-addr HOST"]
    lines += ["```", "", "`lucifer-shard fetch ... --dry-run` lists a node's files and bytes and prints the "
              "equivalent `hf download --include` line; `lucifer-shard verify DEST` checks a fetched share.", ""]
    return "\n".join(lines)
