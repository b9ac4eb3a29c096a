"""The shim's source hashes of a vLLM computed offline, without importing it (maintainer tool; it
imports the installed lucifer_shard, and vLLM not at all):

    python tools/vllm_hashes.py git <git-dir> <commit>...
    python tools/vllm_hashes.py tree <site-packages>...
    python tools/vllm_hashes.py wheel <vllm-*.whl>...

For each symbol the wrappers rely on (`wrappers.SYMBOLS`) that the vLLM has, `compat.source_hash` of
its `inspect.getsource` text (`compat.source_from_module_text`): the values the data file
src/lucifer_shard/runtime_shim/adapt/wrappers/hashes.json keeps per build. tools/vet.py uses these functions on a stock release's wheel.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

from lucifer_shard.runtime_shim.adapt import compat, wrappers


def hashes_at_commit(git_dir: str, commit: str) -> dict[str, str]:
    """Hashes of every symbol present at `commit` of a vLLM git repository."""
    def text(path: str) -> str | None:
        r = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{path}"], capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None

    return _hashes(text)


def hashes_in_tree(site_packages: str) -> dict[str, str]:
    """Hashes of every symbol present in an unpacked vLLM (a site-packages folder or an unzipped wheel:
    the folder that holds `vllm/`)."""
    def text(path: str) -> str | None:
        f = Path(site_packages) / path
        return f.read_text() if f.is_file() else None

    return _hashes(text)


def wheel_text_of(wheel: str):
    """A reader of the wheel's module texts by path (None: not in the wheel), without unpacking it."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())

    def text(path: str) -> str | None:
        return archive.read(path).decode("utf-8") if path in names else None

    return text


def hashes_in_wheel(wheel: str) -> dict[str, str]:
    """Hashes of every symbol present in a vLLM wheel file, without unpacking it."""
    return _hashes(wheel_text_of(wheel))


def symbol_sources(text_of) -> dict[str, str]:
    """The source text (`inspect.getsource`'s) of every symbol of `wrappers.SYMBOLS` present in a vLLM
    whose module texts `text_of(path)` returns."""
    out = {}
    for s in wrappers.SYMBOLS.values():
        text = text_of(s.path)
        if text is None:
            continue
        try:
            out[s.key] = compat.source_from_module_text(text, s.qualname)
        except KeyError:
            continue  # the module exists, the symbol does not
    return out


def source_params(source: str) -> tuple[str, ...]:
    """The parameter names of the function whose source this is, in `inspect.signature`'s order."""
    node = next(n for n in ast.walk(ast.parse(textwrap.dedent(source)))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    a = node.args
    return tuple(x.arg for x in (*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
                                 *([a.kwarg] if a.kwarg else [])))


def _hashes(text_of) -> dict[str, str]:
    return {key: compat.source_hash(text) for key, text in symbol_sources(text_of).items()}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("git", "tree", "wheel") or (argv[0] == "git" and len(argv) < 3):
        print("usage: python tools/vllm_hashes.py git GIT_DIR COMMIT...\n"
              "       python tools/vllm_hashes.py tree SITE_PACKAGES...\n"
              "       python tools/vllm_hashes.py wheel WHEEL...",
              file=sys.stderr)
        return 2
    if argv[0] == "git":
        found = {c: hashes_at_commit(argv[1], c) for c in argv[2:]}
    else:
        hashes = hashes_in_tree if argv[0] == "tree" else hashes_in_wheel
        found = {d: hashes(d) for d in argv[1:]}
    for where, hashes in found.items():
        print(where)
        for k, h in hashes.items():
            print(f"    {k!r}: {h!r},")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
