"""Vet a stock vLLM release for the shim's wrappers, in one command (docs/vllm-releases.md):

    python tools/vet.py VERSION [--against VETTED] [--hashes-only] [--wheels DIR] [--hashes-file FILE]

1. fetches the release's wheel and the last vetted release's (`pip download --no-deps`: pip's cache
   when a test venv was built from it);
2. hashes, from the wheels' text without importing them, every symbol of `wrappers.SYMBOLS`;
3. prints, for each symbol whose source differs from the last vetted release, the unified diff of the
   two sources and whether its parameters still are the ones the wrapper expects: what the
   maintainer reads before accepting a hash;
4. builds the release's CPU test venv (tools/vllm-env.sh: --venv, else $LUCIFER_VLLM_VENV, else
   ~/.cache/lucifer-shard/vllm-VERSION) and runs the stock proofs on it, the candidate row allowed in
   the test harness only (LUCIFER_VET_CANDIDATE, read by tests/shim);
5. on success writes the release's hashes into the data file the shim reads (src/lucifer_shard/runtime_shim/adapt/wrappers/hashes.json:
   review it with git diff) and prints the `Build` row to add to `model/runtimes.SUPPORTED_BUILDS`; until that row
   names the release, its hashes vet nothing (tests/test_build_table.py refuses one without the other).

A maintainer tool: it runs from a checkout of lucifer-shard installed editable (it needs tools/ and
tests/, and is not in the wheel). Imports nothing from vLLM.
Exit 0: the hashes are written and the row is printed; 1: the release failed vetting (a wrapped function gone
or changed, or the stock proofs failed); 2: it could not be vetted (no such release, no wheel, a venv it may not use).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import vllm_hashes  # tools/vllm_hashes.py, beside this file

from lucifer_shard.guarded_io import read_regular
from lucifer_shard.model import runtimes
from lucifer_shard.model.runtimes import release_numbers
from lucifer_shard.runtime_shim.adapt import compat, wrappers

DIST = "vllm"
ROOT = Path(__file__).resolve().parent.parent  # the checkout
# What "the stock proofs" are: vLLM's own DeepSeek-V4 classes loaded from rank files at TP3 (target and
# draft, SM120 and SM90 classes) and TP 1/2/4, and doctor/serve, all against the release in its venv.
STOCK_PROOFS = ("tests/shim/test_stock_tp3.py", "tests/shim/test_real_model.py", "tests/shim/test_doctor.py",
                "tests/shim/test_dspark_model.py", "tests/shim/test_b12x.py")
CANDIDATE_ENV = "LUCIFER_VET_CANDIDATE"  # the candidate, JSON, for the test harness only


@dataclass(frozen=True)
class Candidate:
    """What vetting a release adds: its build row, and its entry in the data file of hashes."""

    build: runtimes.Build
    hashes: dict[str, str]  # symbol key -> source hash in the release, for each symbol of the row's wrappers


class VetError(Exception):
    """One line: what failed and what to do. `exit_code` 2: vet could not judge the release; 1: the
    release failed vetting."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


VENV_GIB = 9.5  # a vllm test venv on disk, measured (docs/vllm-releases.md)
# tools/vllm-env.sh's stamp of the checkout its editable install points at ("<checkout> <pyproject hash>")
PROJECT_STAMP = ".lucifer-project"


def default_venv(version: str) -> Path:
    """Where tools/vllm-env.sh puts the release's venv when no LUCIFER_VLLM_VENV names one (its rule)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "lucifer-shard" / f"{DIST}-{version}"


def venv_problem(venv: Path) -> str | None:
    """Why vet may not build or use `venv` (None: it may). Never another checkout's: vet points the venv's
    editable install at this checkout, which would swap the code under that checkout's make test-shim."""
    venv = venv.absolute()
    if venv == ROOT or ROOT in venv.parents:
        return f"the venv {venv} is inside the checkout {ROOT}; put it outside (--venv DIR)"
    if venv.exists() and not venv.is_dir():
        return f"the venv {venv} is a file; pass --venv DIR for a folder"
    stamp = venv / PROJECT_STAMP
    owner = read_regular(stamp, follow=True).decode().split(" ", 1)[0] if stamp.is_file() else None
    if owner is not None and Path(owner) != ROOT:
        return (f"the venv {venv} is installed for the checkout {owner} (its make test-shim uses it); pass --venv "
                f"DIR for a venv of vet's own (about {VENV_GIB} GiB)")
    return None


def stock_releases() -> list[runtimes.Build]:
    """The vetted releases of the `vllm` distribution, newest first."""
    found = [b for b in runtimes.SUPPORTED_BUILDS if b.stock and b.install == f"pip install {DIST}=={b.commit}"]
    return sorted(found, key=lambda b: release_numbers(b.commit), reverse=True)


def last_vetted(version: str) -> runtimes.Build:
    """The release a new one is compared with: the newest vetted one other than `version`."""
    others = [b for b in stock_releases() if b.commit != version]
    if not others:
        raise VetError(f"no vetted {DIST} release other than {version} in model/runtimes.SUPPORTED_BUILDS to compare with")
    return others[0]


def fetch_wheel(version: str, dest: Path) -> Path:
    """The release's wheel, downloaded into `dest` (pip's cache first)."""
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        f"{DIST}=={version}", "-d", str(dest)], capture_output=True, text=True)
    wheels = sorted(dest.glob(f"{DIST}-{version}-*.whl"))
    if r.returncode or not wheels:
        tail = [ln for ln in (r.stderr or r.stdout).splitlines() if "is ignored" not in ln][-1:]
        raise VetError(f"pip download --no-deps {DIST}=={version} failed ({' '.join(tail) or 'no wheel'}); "
                       f"check that {version} is a release of {DIST}, and the package index")
    return wheels[-1]


def wheel_pin(wheel: Path, name: str) -> str:
    """The version the wheel's metadata pins `name` to (`name==X`), "none" without such a pin."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    m = re.search(rf"^Requires-Dist: {re.escape(name)}==([^\s;]+)\s*$", text, re.M)
    return m.group(1) if m else "none"


def candidate(version: str, wheel: Path, against: runtimes.Build) -> Candidate:
    """What a release gets: the wrappers of the release it is compared with and the hashes of their
    symbols in this wheel; its FlashInfer pin, the draft kinds whose class is in the wheel (the stock proofs
    then load each). Raises VetError when a symbol they rely on is gone."""
    text_of = vllm_hashes.wheel_text_of(str(wheel))
    sources = vllm_hashes.symbol_sources(text_of)
    needed = [s for w in against.wrappers for s in wrappers.WRAPPERS[w].symbols]
    missing = [s.dotted for s in needed if s.key not in sources]
    moved = [s.dotted for s in needed
             if s.key in sources and not s.signature_ok(vllm_hashes.source_params(sources[s.key]))]
    if missing or moved:
        raise VetError(f"{DIST} {version} lacks {', '.join(missing) or 'nothing'} and changed the parameters of "
                       f"{', '.join(moved) or 'nothing'}: the wrappers {', '.join(against.wrappers)} cannot be "
                       f"installed on it as they are; port them first", exit_code=1)
    build = dataclasses.replace(against, commit=version, label=against.label.replace(against.commit, version),
                                flashinfer=wheel_pin(wheel, "flashinfer-python"), install=f"pip install {DIST}=={version}",
                                draft_kinds=tuple(k for k, path in runtimes.DRAFT_CLASS_FILES.items() if text_of(path)))
    return Candidate(build, {s.key: compat.source_hash(sources[s.key]) for s in needed})


def changes(version: str, wheel: Path, against: runtimes.Build, against_wheel: Path) -> list[str]:
    """For each symbol of wrappers.SYMBOLS whose source differs between the two wheels: a header line,
    the parameter check, what its wrapper's file says to read, and the unified diff of the two sources."""
    new_text, old_text = vllm_hashes.wheel_text_of(str(wheel)), vllm_hashes.wheel_text_of(str(against_wheel))
    new, old = vllm_hashes.symbol_sources(new_text), vllm_hashes.symbol_sources(old_text)
    out = []
    for key, sym in wrappers.SYMBOLS.items():
        if new.get(key) == old.get(key):
            continue
        users = [w for w in against.wrappers if sym in wrappers.WRAPPERS[w].symbols]
        use = f"used by {', '.join(users)}" if users else f"not used on {DIST} releases"
        if key not in new:
            out.append(f"=== {sym.dotted}: gone in {version} ({use})")
            continue
        params = vllm_hashes.source_params(new[key])
        sig = "parameters unchanged" if sym.signature_ok(params) else \
            f"PARAMETERS CHANGED: ({', '.join(params)}) != expected ({', '.join(sym.params)})"
        out.append(f"=== {sym.dotted} ({use}): {compat.source_hash(old[key])[:19] if key in old else 'absent'} -> "
                   f"{compat.source_hash(new[key])[:19]}, {sig}")
        out.extend(f"read: {wrappers.WRAPPERS[w].read_in_diff}" for w in users)
        out.extend(difflib.unified_diff(old.get(key, "").splitlines(), new[key].splitlines(),
                                        f"{DIST}=={against.commit}:{sym.path}", f"{DIST}=={version}:{sym.path}",
                                        lineterm=""))
    return out


def row_text(b: runtimes.Build) -> str:
    """The Python text of a row of model/runtimes.SUPPORTED_BUILDS (evaluates to an equal Build)."""
    return (f"    Build(\n        commit={b.commit!r},\n        label={b.label!r},\n"
            f"        draft_virtual_tp={b.draft_virtual_tp!r},\n        flashinfer={b.flashinfer!r},\n"
            f"        branches={b.branches!r},\n        wrappers={b.wrappers!r},\n        install={b.install!r},\n"
            f"        draft_kinds={b.draft_kinds!r},\n    ),")


def write_hashes(c: Candidate, path: Path) -> str:
    """Put the release's hashes into the data file `path` (its entry replaced, the others kept, the text
    compat.hashes_text's); what changed, in words."""
    hashes = compat.read_hashes(path)
    before = hashes.get(c.build.commit)
    hashes[c.build.commit] = c.hashes
    path.write_text(compat.hashes_text(hashes))
    what = "added" if before is None else "unchanged" if before == c.hashes else "changed"
    return f"{path}: the hashes of {c.build.commit} {what} (review: git diff {path.name})"


def candidate_json(c: Candidate) -> str:
    return json.dumps({"build": dataclasses.asdict(c.build), "hashes": c.hashes})


def candidate_from_json(text: str) -> Candidate:
    d = json.loads(text)
    b = d["build"]
    return Candidate(runtimes.Build(**{**b, **{k: tuple(b[k]) for k in ("branches", "wrappers", "draft_kinds")}}),
                     d["hashes"])


def run_proofs(version: str, found: Candidate, venv: Path) -> int:
    """The stock proofs on the release's CPU test venv `venv` (built on first use), the candidate
    allowed: pytest's exit code. VetError when the venv cannot be made or used (not a failed proof)."""
    script = ROOT / "tools" / "vllm-env.sh"
    if not script.is_file():
        raise VetError(f"{script} not found: the proofs need a checkout of lucifer-shard installed editable "
                       f"(pip install -e); run vet from it, or pass --hashes-only")
    env = {**os.environ, "LUCIFER_VLLM_VENV": str(venv), "LUCIFER_VLLM_VERSION": version}
    print(f"$ LUCIFER_VLLM_VENV={venv} LUCIFER_VLLM_VERSION={version} bash tools/vllm-env.sh", flush=True)
    made = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if made.returncode:
        said = [ln for ln in made.stderr.splitlines() if ln.strip()][-1:]
        raise VetError(f"the venv {venv} could not be made or used ({' '.join(said) or f'exit {made.returncode}'})")
    cmd = ["bash", str(script), "python", "-m", "pytest", "-q", "-m", "vllm", *STOCK_PROOFS]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd, cwd=ROOT, env={**env, CANDIDATE_ENV: candidate_json(found)}).returncode


def vet(version: str, against_version: str | None, hashes_only: bool, work: Path, venv: Path, hashes_file: Path
        ) -> int:
    against = next((b for b in stock_releases() if b.commit == against_version), None) if against_version \
        else last_vetted(version)
    if against is None:
        raise VetError(f"--against {against_version} is not a vetted {DIST} release "
                       f"({', '.join(b.commit for b in stock_releases())})")
    problem = None if hashes_only else venv_problem(venv)
    if problem:  # before the downloads: a venv it may not use is known at once
        raise VetError(problem)
    wheel, against_wheel = fetch_wheel(version, work), fetch_wheel(against.commit, work)
    print(f"{wheel.name}, compared with the last vetted release {against_wheel.name}")
    hashes = vllm_hashes.hashes_in_wheel(str(wheel))
    for key, sym in wrappers.SYMBOLS.items():
        print(f"  {sym.dotted}: {hashes.get(key, 'absent')}")
    diff = changes(version, wheel, against, against_wheel)
    print("\n".join(diff) if diff else f"no symbol's source differs from {against.commit}")
    found = candidate(version, wheel, against)
    if not hashes_only:
        rc = run_proofs(version, found, venv)
        if rc:
            print(f"vet {version}: the stock proofs failed (pytest exit {rc}); do not add the row", file=sys.stderr)
            return 1
    print(write_hashes(found, hashes_file))
    unproven = " (hashes only: the stock proofs did not run)" if hashes_only else ""
    print(f"row for model/runtimes.SUPPORTED_BUILDS{unproven} (stock releases newest first):")
    print(row_text(found.build))
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python tools/vet.py",
                                description="Vet a stock vLLM release for the shim's wrappers (docs/vllm-releases.md).",
                                epilog="Exit 0: the hashes are written and the row is printed; 1: the release failed "
                                       "vetting; 2: it could not "
                                       "be vetted (no such release, a folder or venv it may not use).")
    p.add_argument("version", help="the vLLM release, e.g. 0.35.0")
    p.add_argument("--against", help="the vetted release to diff with (default: the newest other one)")
    p.add_argument("--hashes-only", action="store_true", help="fetch, hash and diff; no venv, no proofs")
    p.add_argument("--wheels", type=Path, help="keep the wheels in this folder (default: a temporary one)")
    p.add_argument("--hashes-file", type=Path, default=compat.HASHES_FILE,
                   help="the data file of vetted hashes that gets the release's (default: the one the shim reads, "
                        "src/lucifer_shard/runtime_shim/adapt/wrappers/hashes.json; review the change with git diff)")
    p.add_argument("--venv", type=Path, help=f"the release's test venv for the stock proofs, built there once and "
                   f"reused (about {VENV_GIB} GiB, a few minutes); its editable install is pointed at this checkout, "
                   f"so vet refuses one installed for another checkout (default: $LUCIFER_VLLM_VENV, else "
                   f"~/.cache/lucifer-shard/vllm-VERSION)")
    args = p.parse_args(argv)
    if args.wheels is not None and args.wheels.exists() and not args.wheels.is_dir():
        print(f"error: vet: --wheels {args.wheels}: a file, not a folder; pass a folder to keep the wheels in",
              file=sys.stderr)
        return 2
    venv = args.venv or Path(os.environ.get("LUCIFER_VLLM_VENV") or default_venv(args.version))
    try:
        if args.wheels:
            args.wheels.mkdir(parents=True, exist_ok=True)
            return vet(args.version, args.against, args.hashes_only, args.wheels, venv, args.hashes_file)
        with tempfile.TemporaryDirectory(prefix="lucifer-vet-") as work:
            return vet(args.version, args.against, args.hashes_only, Path(work), venv, args.hashes_file)
    except VetError as e:
        print(f"error: vet: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a --wheels folder it cannot make, a full disk: the machine's, one line
        print(f"error: vet: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
