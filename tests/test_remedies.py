"""Remedies as data (errors.REMEDIES): each remedy is one row, spelled once; a raise site names its row
instead of writing the command out; the CLI's line ends with the row and `--json` gives it apart."""
from __future__ import annotations

import ast
import re
from dataclasses import asdict
from pathlib import Path

import lucifer_shard.errors as errors
from lucifer_shard.errors import CONVERT_RESUME, REMEDIES, LuciferError, OutputError, Remedy
from lucifer_shard.outnames import STATE_DIR

from helpers import REPO, one_error, run

SRC = REPO / "src" / "lucifer_shard"
COMMANDS = "plan|convert|diff|verify|inspect|check-numerics|synth|stage|fetch|doctor|serve|smoke"
# A remedy spelled at its raise site: a command of the tool to run (not one that holds a lock, "being
# written by lucifer-shard convert", the output of one, or wrote a folder), or "run ... again", "convert again", "with --resume".
SPELLED = re.compile(rf"(?<!by )(?<!another )(?<!a )(?<!of )lucifer-shard ({COMMANDS})\b(?! wrote)|convert again|"
                     rf"\brun (\S+ ){{0,4}}again\b|with --resume\b")
ERROR_CLASSES = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, LuciferError)}
# Rooms whose raise sites still spell their remedies (being moved to the table room by room).
NOT_YET: set[str] = set()


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _clicks(exc: ast.expr) -> bool:
    """A usage error of click's own (its text is click's usage, with the example of a command line)."""
    return isinstance(exc, ast.Call) and isinstance(exc.func, ast.Attribute) and \
        isinstance(exc.func.value, ast.Name) and exc.func.value.id == "click"


def _remedy_texts(tree: ast.Module) -> list[ast.Constant]:
    """The strings of every raise statement, every call of an error class or of errors.fault, and of every
    module-level constant a raise site names (a remedy kept beside its raise sites)."""
    sites = [n.exc for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None
             and not _clicks(n.exc)]
    sites += [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) in ERROR_CLASSES | {"fault"}]
    named = {n.id for s in sites for n in ast.walk(s) if isinstance(n, ast.Name)}
    sites += [s.value for s in tree.body if isinstance(s, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id in named for t in s.targets)]
    found = {id(c): c for s in sites for c in ast.walk(s) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return list(found.values())


def spelled_remedies(root: Path) -> list[str]:
    """`file:line: text` of every remedy spelled outside the table (errors.py) under `root`."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "errors.py" or rel.split("/")[0] in NOT_YET or rel in NOT_YET:
            continue
        for c in _remedy_texts(ast.parse(path.read_text(), str(path))):
            if SPELLED.search(c.value):
                hits.append(f"{rel}:{c.lineno}: {c.value}")
    return hits


def test_no_raise_site_spells_its_remedy():
    assert spelled_remedies(SRC) == []


def test_the_scan_finds_a_spelled_remedy(tmp_path):
    (tmp_path / "room.py").write_text(
        'from lucifer_shard.errors import OutputError\n'
        'AGAIN = "run the same fetch again"\n'
        'def f(out):\n'
        '    raise OutputError(f"{out}: damaged; lucifer-shard verify {out} names every problem; {AGAIN}")\n'
        'def g(out):\n'
        '    raise OutputError(f"{out}: locked by lucifer-shard convert; wait")\n')
    assert sorted(h.split(":")[1] for h in spelled_remedies(tmp_path)) == ["2", "4"]


def test_each_row_is_used():
    """Every row is named somewhere but its own definition (errors.fault's default counts)."""
    used = set()
    for path in SRC.rglob("*.py"):
        used |= {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Load)}
    assert set(REMEDIES) - used == set()


def test_a_row_is_one_line_with_its_first_step_and_fills():
    row = Remedy("lucifer-shard verify {out}", "it names every problem")
    assert str(row.at(out="/o")) == "run lucifer-shard verify /o (it names every problem)"
    assert str(row.at(out="/o").after("let the writer finish", "fetch another copy")) == (
        "let the writer finish, then run lucifer-shard verify /o (it names every problem), or fetch another copy")
    e = OutputError("/o: damaged", remedy=row.at(out="/o"))
    assert (str(e), e.message, e.remedy.command) == ("/o: damaged; run lucifer-shard verify /o (it names every "
                                                     "problem)", "/o: damaged", "lucifer-shard verify /o")


def test_the_cli_line_ends_with_the_row_and_json_gives_it_apart(tmp_path):
    out = tmp_path / "out"
    (out / STATE_DIR).mkdir(parents=True)  # an unfinished conversion: convert --resume finishes it
    line = one_error(run("verify", out), 2, f"{out} holds an unfinished conversion")
    assert line.endswith(f"; {CONVERT_RESUME}"), line
    import json
    doc = json.loads(run("verify", out, "--json").stdout)
    assert doc["error"]["remedy"] == asdict(CONVERT_RESUME)
    assert doc["error"]["message"] == line.removeprefix("error: ")
    usage = json.loads(run("verify", tmp_path / "nothing", "--json").stdout)
    assert usage["error"]["remedy"] is None or usage["error"]["message"].endswith(str(Remedy(**usage["error"]["remedy"])))
