"""An output's names, below every room (the source reader, the manifest and the commands all need them):
the manifest's and the state folder's names, the side files copied beside config.json, a rank file's rank;
and what may lie in an output's role and rank folders: the one rule `verify` (a stray entry is a finding)
and `convert --resume` (it removes its own temporary files and refuses to finish beside anything
else, since verify would then fail) share.

In `target/` and `draft/` of the roles the conversion writes there are only the folders `rank-<r>`,
r < TP, and in those only the rank files the conversion lists; `.part-NNNNN.safetensors.partial`
beside a listed file is the temporary name a stopped convert left, the tool's to remove."""
from __future__ import annotations

import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from .guarded_io import Tree, partial_name

ROLES = ("target", "draft")
RANK_DIR = re.compile(r"rank-(\d+)")
MANIFEST_NAME = "lucifer-manifest.json"
STATE_DIR = ".lucifer"
# Files copied byte-identical into the output next to config.json.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")


def rank_of(rel: str) -> int:
    """The TP rank of rank file `rel` (`role/rank-<r>/part-<NNNNN>.safetensors`)."""
    return int(rel.split("/")[1].removeprefix("rank-"))


@dataclass(frozen=True)
class Stray:
    """An entry of a role or rank folder that the output does not list, in verify's words."""

    rel: str
    what: str
    role: str
    rank: int | None = None
    ours: bool = False  # a temporary file of a stopped convert: convert --resume removes it

    @property
    def line(self) -> str:
        return f"{self.rel}: {self.what}"


def strays(tree: Tree, listed: Iterable[str], roles: Iterable[str], tp: int) -> list[Stray]:
    """Every entry of OUT's role and rank folders that is not one of the `listed` rank files (nor a
    folder holding them), sorted; links are named, never followed."""
    listed, roles = set(listed), set(roles)
    temporaries = {partial_name(rel) for rel in listed}
    found = []
    for role in ROLES:
        st = tree.lstat(role)
        if st is None:
            continue
        if stat.S_ISLNK(st.st_mode):
            found.append(Stray(role, "is a symlink; an output's folders are real directories, re-run convert "
                                     "--force", role))
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        if role not in roles:
            found.append(Stray(role, "folder of a role this conversion did not write; remove it", role))
            continue
        for name, child in sorted(tree.entries(role).items()):
            rel = f"{role}/{name}"
            if stat.S_ISLNK(child.st_mode):
                found.append(Stray(rel, "is a symlink; an output's folders are real directories, re-run convert "
                                        "--force", role))
                continue
            m = RANK_DIR.fullmatch(name)
            if not (stat.S_ISDIR(child.st_mode) and m and int(m[1]) < tp):
                found.append(Stray(rel, f"unexpected entry in {role}/ (TP is {tp}); remove it", role))
                continue
            rank = int(m[1])
            for fname, fst in sorted(tree.entries(rel).items()):
                frel = f"{rel}/{fname}"
                if frel in listed:
                    continue
                if frel in temporaries and stat.S_ISREG(fst.st_mode):
                    found.append(Stray(frel, "temporary file of a stopped convert (not in the manifest); convert "
                                             "--resume removes it", role, rank, ours=True))
                else:
                    found.append(Stray(frel, "unexpected file in a rank folder (not in the manifest); remove it",
                                       role, rank))
    return found
