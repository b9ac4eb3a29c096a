"""The conventions every command shares, walked through ONE table of commands (issue 27's "Done when"):
usage errors (an unknown option, a bad value, a missing argument), bad paths (a missing OUT or MODEL,
OUT a file, a damaged output), --json on success and on failure (parsed strictly), a closed stdout,
-q and -v. Each run asserts one error style (exactly one `error:` line on stderr), the envelope with
its kind from ERROR_KINDS, and the exit code that kind has.

CliRunner everywhere except for the closed stdout, which needs a real file descriptor."""
from __future__ import annotations

import importlib.util
import itertools
import json
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from lucifer_shard.cli import cli
from lucifer_shard.cli.console import QUIET, SCHEMA_VERSION, exit_code_lines
from lucifer_shard.errors import BROKEN_PIPE, ERROR_KINDS, Remedy, exit_codes

from helpers import one_error, run, scratch
from vllmstandin import StandIn

REPO = Path(__file__).resolve().parent.parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class Row:
    """One command. Arguments name the fixtures as {model} (a checkpoint), {out} (its output), {new}
    (a fresh path), {file} (a regular file), {missing} (nothing there), {damaged} (an edited output)."""

    good: tuple[str, ...]  # a run that works on this machine
    captured: str | None  # -q's whole stdout as a regex ({...} filled in); None: nothing at all
    bad_value: tuple[str, ...] | None  # None: the command has no option that takes a value
    unknown_option: tuple[str, ...]
    missing_argument: tuple[str, ...] | None  # None: every argument is optional
    bad_paths: tuple[tuple[tuple[str, ...], str], ...]  # (argv, kind)
    reads_out: bool = False  # a damaged output is kind mismatch (doctor and serve report it as a check)
    good_fails: str | None = None  # the kind of `good` where it cannot pass here


MISSING_OUT, OUT_A_FILE = "{missing}", "{file}"
ROWS: dict[str, Row] = {
    "plan": Row(("plan", "--tp", "3", "--arch", "sm120", "{model}"), r"\d+",
                ("plan", "--tp", "abc", "{model}"), ("plan", "--tp", "3", "--arch", "sm120", "--bogus", "{model}"), ("plan", "{model}"),
                ((("plan", "--tp", "3", "--arch", "sm120", "{missing}"), "source"),
                 (("plan", "--tp", "3", "--arch", "sm120", "{model}", OUT_A_FILE), "output"))),
    "convert": Row(("convert", "--tp", "3", "--arch", "sm120", "{model}", "{new}"), "{new}",
                   ("convert", "--tp", "3", "--arch", "sm80", "{model}", "{new}"),
                   ("convert", "--tp", "3", "--arch", "sm120", "--bogus", "{model}", "{new}"),
                   ("convert", "--tp", "3", "--arch", "sm120", "{model}"),
                   ((("convert", "--tp", "3", "--arch", "sm120", "{missing}", "{new}"), "source"),
                    (("convert", "--tp", "3", "--arch", "sm120", "{model}", OUT_A_FILE), "output"))),
    "diff": Row(("diff", "{out}"), None,
                ("diff", "--max-mismatches", "0", "{out}"), ("diff", "--bogus", "{out}"), ("diff",),
                ((("diff", MISSING_OUT), "output"), (("diff", OUT_A_FILE), "output"),
                 (("diff", "{out}", "{missing}"), "source")), reads_out=True),
    "verify": Row(("verify", "{out}"), None,
                  ("verify", "--max-mismatches", "x", "{out}"), ("verify", "--bogus", "{out}"), ("verify",),
                  ((("verify", MISSING_OUT), "output"), (("verify", OUT_A_FILE), "output")), reads_out=True),
    "inspect": Row(("inspect", "{out}"), "[0-9a-f]{64}",
                   None, ("inspect", "--bogus", "{out}"), ("inspect",),
                   ((("inspect", MISSING_OUT), "output"), (("inspect", OUT_A_FILE), "output")), reads_out=True),
    "check-numerics": Row(("check-numerics", "{out}", "--layers", "0", "--tokens", "4"), None,
                          ("check-numerics", "--tokens", "x", "{out}"), ("check-numerics", "--bogus", "{out}"),
                          ("check-numerics",),
                          ((("check-numerics", MISSING_OUT), "output"), (("check-numerics", OUT_A_FILE), "output"),
                           (("check-numerics", "{out}", "{missing}"), "source")), reads_out=True),
    "synth": Row(("synth", "tiny", "{new}"), "{new}",
                 ("synth", "huge", "{new}"), ("synth", "tiny", "--bogus", "{new}"), ("synth", "tiny"),
                 ((("synth", "tiny", OUT_A_FILE), "output"),)),
    "stage": Row(("stage", "{out}", "{new}", "--ranks", "1"), "{new}",
                 ("stage", "{out}", "{new}", "--nnodes", "x", "--node-rank", "0"),
                 ("stage", "{out}", "{new}", "--ranks", "1", "--bogus"), ("stage", "{out}"),
                 ((("stage", MISSING_OUT, "{new}", "--ranks", "1"), "output"),
                  (("stage", "{out}", OUT_A_FILE, "--ranks", "1"), "output"),
                  (("stage", "{out}", "{new}", "--ranks", "5"), "usage"))),
    "fetch": Row(("fetch", "{out}", "{new}", "--ranks", "1"), "{new}",
                 ("fetch", "{out}", "{new}", "--nnodes", "x", "--node-rank", "0"),
                 ("fetch", "{out}", "{new}", "--ranks", "1", "--bogus"), ("fetch", "{out}"),
                 ((("fetch", MISSING_OUT, "{new}", "--ranks", "1"), "output"),
                  (("fetch", "{out}", OUT_A_FILE, "--ranks", "1"), "output"),
                  (("fetch", "{out}", "{new}", "--ranks", "5"), "usage"))),
    "doctor": Row(("doctor", "{out}"), None,
                  None, ("doctor", "--bogus"), None,
                  ((("doctor", MISSING_OUT), "output"), (("doctor", OUT_A_FILE), "output")),
                  good_fails=None if HAS_VLLM else "check_failed"),  # without vLLM its check fails
    "serve": Row(("serve", "{out}", "--dry-run"), r"vllm serve \S+ .*--load-format lucifer_tp3.*",
                 ("serve", "{out}", "--mtp", "--mtp-tokens", "0", "--dry-run"), ("serve", "{out}", "--bogus"),
                 ("serve",),
                 ((("serve", MISSING_OUT, "--dry-run"), "output"), (("serve", OUT_A_FILE, "--dry-run"), "output"))),
    # {url}: a stand-in vLLM server (tests/vllmstandin.py); {nothing}: a port where nothing listens
    "smoke": Row(("smoke", "{url}", "--max-tokens", "2", "--concurrency", "1"), None,
                 ("smoke", "{url}", "--concurrency", "99"), ("smoke", "{url}", "--bogus"), ("smoke",),
                 ((("smoke", "{nothing}"), "server"), (("smoke", "{file}"), "usage"))),
    "cache": Row(("cache", "show", "{out}"), None,
                 ("cache", "bogus", "{out}"), ("cache", "show", "--bogus", "{out}"), ("cache", "show"),
                 ((("cache", "show", MISSING_OUT), "output"), (("cache", "show", OUT_A_FILE), "output"))),
}
USAGE_CASES = ("bad_value", "unknown_option", "missing_argument")


@pytest.fixture(scope="module")
def shared_paths(tmp_path_factory, tiny_random, converted) -> Iterator[dict[str, Path]]:
    """The fixtures the table names; {out} is of the random fill, whose numbers are finite."""
    with scratch(tmp_path_factory, "conventions") as root:
        (root / "afile").write_text("not an output\n")
        out = converted(source=tiny_random)
        damaged = root / "damaged"
        shutil.copytree(out, damaged)
        manifest = damaged / "lucifer-manifest.json"
        doc = json.loads(manifest.read_text())
        doc["tool_version"] = "0.0.0-edited"  # still a well-formed manifest, but not the one convert wrote
        manifest.write_text(json.dumps(doc, indent=1))
        (root / "empty").mkdir()
        unfinished = root / "unfinished"  # a convert stopped after its manifest, before COMPLETE
        shutil.copytree(out, unfinished)
        (unfinished / "COMPLETE").unlink()
        with socket.socket() as sock:  # a port that was free a moment ago: nothing answers there
            sock.bind(("127.0.0.1", 0))
            nothing = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with StandIn() as server:
            yield {"model": tiny_random, "out": out, "file": root / "afile", "missing": root / "missing",
                   "damaged": damaged, "empty": root / "empty", "unfinished": unfinished, "url": server.url,
                   "nothing": nothing}


@pytest.fixture
def paths(shared_paths, tmp_path) -> dict[str, Path]:
    """shared_paths, and the root of the {new} outputs a test writes: its own tmp_path, gone when it passes
    (dozens of converts there would otherwise stay until the module ends)."""
    return {**shared_paths, "root": tmp_path}


_fresh = itertools.count()


def fill(argv, paths: dict[str, Path]) -> tuple[list[str], dict[str, str]]:
    values = {k: str(v) for k, v in paths.items()}
    values["new"] = str(paths["root"] / f"new-{next(_fresh)}")
    return [a.format(**values) for a in argv], values


def strict(text: str) -> dict:
    """The one envelope on stdout, parsed as strict JSON (NaN, Infinity refused), of the known shape."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    doc = json.loads(text, parse_constant=refuse)
    assert set(doc) == {"schema_version", "command", "ok", "error", "result"}, doc.keys()
    assert doc["schema_version"] == SCHEMA_VERSION == 2
    return doc


def assert_fails(argv: list[str], kind: str, command: str):
    """`argv` fails with `kind`: one error line and the kind's exit code; with --json (just after the
    command name, and last) also the envelope, ok false, that kind and code. Returns the text run."""
    code = ERROR_KINDS[kind][0]
    r = run(*argv)
    message = one_error(r, code).removeprefix("error: ")
    cut = argv.index("--") if "--" in argv else len(argv)
    for placed in ([argv[0], "--json", *argv[1:]], [*argv[:cut], "--json", *argv[cut:]]):
        j = run(*placed)
        doc = strict(j.stdout)
        assert j.exit_code == code and not doc["ok"] and doc["command"] == command, (placed, j.stdout)
        remedy = doc["error"]["remedy"]  # the row the line ends with, given apart
        assert doc["error"] == {"kind": kind, "message": message, "exit_code": code, "remedy": remedy}, doc["error"]
        assert remedy is None or message.endswith(str(Remedy(**remedy))), (message, remedy)
        assert one_error(j, code).removeprefix("error: ") == message
    return r


# ---------------------------------------------------------------- the table is every command


def test_the_table_is_every_command():
    assert set(ROWS) == set(cli.commands) == set(QUIET)


# ---------------------------------------------------------------- usage errors


@pytest.mark.parametrize("command,case", [(c, k) for c in ROWS for k in USAGE_CASES
                                          if getattr(ROWS[c], k) is not None])
def test_usage_errors_are_one_line_and_the_envelope(command, case, paths):
    argv, _ = fill(getattr(ROWS[command], case), paths)
    stderr = assert_fails(argv, "usage", command).stderr
    assert stderr.rstrip("\n").endswith(f"; see lucifer-shard {command} --help"), stderr
    assert run(*argv).stdout == ""  # nothing but the envelope goes to stdout, and only with --json


def test_group_usage_errors_and_json_after_the_double_dash(paths):
    assert_fails(["no-such-command"], "usage", "no-such-command")
    # after `--` everything is serve's vLLM arguments: `--json` there is not serve's option
    argv, _ = fill(("serve", "--bogus", "--", "--json"), paths)
    r = run(*argv)
    assert r.stdout == "" and one_error(r, 2)


def test_help_and_version_are_clicks():
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("lucifer-shard, version ")
    for argv in (["--help"], ["plan", "--help"], ["serve", "-h"]):
        r = run(*argv)
        assert r.exit_code == 0 and r.stdout.startswith("Usage: ") and r.stderr == ""


# ---------------------------------------------------------------- bad paths and damaged outputs


@pytest.mark.parametrize("command,i", [(c, i) for c in ROWS for i in range(len(ROWS[c].bad_paths))])
def test_bad_paths_have_their_kind_and_code(command, i, paths):
    template, kind = ROWS[command].bad_paths[i]
    argv, _ = fill(template, paths)
    assert_fails(argv, kind, command)


@pytest.mark.parametrize("command", [c for c in ROWS if ROWS[c].reads_out])
def test_a_damaged_output_is_a_mismatch_for_every_check(command, paths):
    argv, values = fill(ROWS[command].good, paths)
    argv = [a.replace(values["out"], values["damaged"]) for a in argv]
    stderr = assert_fails(argv, "mismatch", command).stderr
    assert "manifest_digest does not match" in stderr, stderr
    if command == "inspect":  # the summary first, then the one line
        assert "manifest digest MISMATCH" in run(*argv).stdout


# ---------------------------------------------------------------- messages that name the next step

# (argv, kind, what the one error line says): what is not an output, for the commands that get an OUT
# to serve, names the step that makes one; plan refuses what convert refuses; serve refuses before vLLM
# starts what the plugin would refuse at load; a typo of an option gets click's did-you-mean.
NEXT_STEP = (
    (("doctor", "{model}"), "output", "{model}: this is a checkpoint: convert it first, then use OUT; run lucifer-shard convert"),
    (("serve", "{model}", "--dry-run"), "output", "{model}: this is a checkpoint: convert it first"),
    (("doctor", "{empty}"), "output", "{empty}: not a lucifer-shard output (no lucifer-manifest.json): convert into"),
    (("serve", "{empty}", "--dry-run"), "output", "{empty}: not a lucifer-shard output (no lucifer-manifest.json)"),
    (("doctor", "{unfinished}"), "output", "{unfinished}: unfinished; run the same convert command with --resume"),
    (("serve", "{unfinished}", "--dry-run"), "output", "{unfinished}: unfinished; run the same convert command with --resume"),
    (("serve", "{file}", "--dry-run"), "output", "{file}: a file, not an output directory"),
    (("plan", "--tp", "3", "--expert-layout", "kernel", "{model}"), "usage", "--arch is required with --expert-layout kernel"),
    (("serve", "{out}", "--dry-run", "--", "--hf-overrides", "{{}}"), "usage",
     "--hf-overrides is in the vLLM arguments but the plugin sets it from the manifest"),
    (("serve", "{out}", "--dryrun"), "usage", "No such option '--dryrun'. Did you mean '--dry-run'?"),
)


@pytest.mark.parametrize("i", range(len(NEXT_STEP)))
def test_messages_name_the_next_step_with_their_kind(i, paths):
    template, kind, message = NEXT_STEP[i]
    argv, values = fill(template, paths)
    r = assert_fails(argv, kind, argv[0])
    stderr = r.stderr
    assert message.format(**values) in one_error(r, ERROR_KINDS[kind][0]), stderr
    if kind == "output":  # never a load-format check where OUT is no output at all
        assert "lucifer_tp3" not in stderr, stderr


def test_convert_ends_with_the_next_steps(paths):
    argv, values = fill(ROWS["convert"].good, paths)
    r = run(*argv)
    assert r.exit_code == 0, r.stderr
    out = values["new"]
    assert re.fullmatch(rf"next: lucifer-shard diff {re.escape(out)}; copy {re.escape(out)} \([\d.]+ MiB, without "
                        rf"\.lucifer/\) to the serving host; lucifer-shard serve {re.escape(out)} --dry-run",
                        r.stdout.strip().splitlines()[-1]), r.stdout


def test_the_dry_run_without_vllm_prints_skipped_checks_not_failed_ones(paths):
    if HAS_VLLM:
        pytest.skip("vLLM is importable here: the environment is checked, nothing is skipped")
    r = run("serve", str(paths["out"]), "--dry-run")
    assert r.exit_code == 0 and "[FAIL]" not in r.stdout and "[skip] vllm: " in r.stdout, r.stdout
    assert "will not work here" not in r.stdout and "environment check(s) skipped" in r.stdout


# ---------------------------------------------------------------- --json on success


@pytest.mark.parametrize("command", ROWS)
def test_json_on_success_is_one_strict_envelope(command, paths):
    row = ROWS[command]
    argv, _ = fill(row.good, paths)
    r = run(*argv, "--json")
    doc = strict(r.stdout)
    assert doc["command"] == command and doc["result"] is not None
    if row.good_fails:
        code = ERROR_KINDS[row.good_fails][0]
        assert r.exit_code == code and doc["error"]["kind"] == row.good_fails and doc["error"]["exit_code"] == code
    else:
        assert r.exit_code == 0 and doc["ok"] and doc["error"] is None, r.stderr


def test_non_finite_numbers_are_null(converted, monkeypatch):
    """check-numerics' errors of a reference that is not finite: null in the envelope, not NaN."""
    from lucifer_shard.proof import check_numerics as cn

    def nan_report(out, model, **kw):
        return cn.NumericsReport(str(out), str(model), 3, 4, 0, [0], [cn.Result(0, "routed MoE", float("nan"),
                                                                          float("inf"), float("-inf"), 5e-3, False)])

    monkeypatch.setattr(cn, "check_numerics", nan_report)
    r = run("check-numerics", "--json", str(converted()))
    doc = strict(r.stdout)
    assert r.exit_code == 1 and doc["error"]["kind"] == "mismatch"
    assert doc["result"]["results"][0]["max_abs"] is None and doc["result"]["results"][0]["rel_fro"] is None


# ---------------------------------------------------------------- -q and -v


@pytest.mark.parametrize("command", ROWS)
def test_quiet_is_the_capture_value_and_verbose_adds_lines(command, paths):
    row = ROWS[command]
    runs, quiet_values = {}, {}
    for flags in ((), ("-q",), ("-v",), ("-vv",)):
        argv, quiet_values = fill(row.good, paths) if flags == ("-q",) else (fill(row.good, paths)[0], quiet_values)
        runs[flags] = r = run(*argv, *flags)
        assert r.exit_code == (ERROR_KINDS[row.good_fails][0] if row.good_fails else 0), (flags, r.stderr)
    quiet = runs[("-q",)].stdout
    if row.captured is None:
        assert quiet == "", quiet
    else:  # {new}: the fresh path of the -q run itself
        assert re.fullmatch(row.captured.replace("{new}", re.escape(quiet_values["new"])) + "\n", quiet), quiet
    assert runs[()].stdout and runs[()].stdout != quiet
    lines = {flags: len(r.stderr.splitlines()) for flags, r in runs.items()}
    assert lines[("-v",)] > lines[()] and lines[("-vv",)] > lines[("-v",)], lines
    assert "DEBUG" not in runs[("-v",)].stderr


def test_quiet_and_verbose_exclude_each_other(paths):
    assert_fails(["verify", "-q", "-v", str(paths["out"])], "usage", "verify")


def test_the_option_help_says_what_quiet_leaves():
    for name, (what, _) in QUIET.items():
        text = " ".join(run(name, "--help").stdout.split())
        assert f"stdout holds {what}" in text, (name, text)
        assert "-vv: also per tensor" in text, name


# ---------------------------------------------------------------- a closed stdout


def closed_stdout(argv: list[str]) -> subprocess.CompletedProcess:
    """Run the command with file descriptor 1 closed, as `lucifer-shard ... >&-` does."""
    return subprocess.run(["bash", "-c", 'exec "$@" >&-', "-", sys.executable, "-m", "lucifer_shard.cli", *argv],
                          stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("command", ROWS)
@pytest.mark.parametrize("as_json", [False, True])
def test_a_closed_stdout_exits_141(command, as_json, paths):
    argv, _ = fill(ROWS[command].good, paths)
    r = closed_stdout([*argv, *(["--json"] if as_json else [])])
    assert r.returncode == BROKEN_PIPE == 141, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


def test_a_closed_stdout_does_not_matter_when_nothing_is_written(paths):
    assert closed_stdout(["verify", "-q", str(paths["out"])]).returncode == 0


# ---------------------------------------------------------------- one table of kinds and codes


CONVENTIONS_PAGE = REPO / "docs" / "cli.md"  # the reference the README links; its tables are these tables


def _readme_rows(header: str) -> list[list[str]]:
    """The rows of the markdown table that starts with `header` in the Conventions section of the CLI
    reference page."""
    text = CONVENTIONS_PAGE.read_text()
    section = text[text.index("## Conventions (every command)"):]
    lines = section[section.index(header):].splitlines()[2:]
    rows = []
    for line in lines:
        line = line.strip()
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_readme_kinds_are_error_kinds_both_ways():
    rows = _readme_rows("| kind | exit | meaning |")
    readme = {kind.strip("`"): (int(code), meaning) for kind, code, meaning in rows}
    assert readme == ERROR_KINDS and [r[0].strip("`") for r in rows] == list(ERROR_KINDS)


def test_readme_exit_codes_are_the_table_both_ways():
    rows = _readme_rows("| code | meaning | kinds |")
    readme = [(int(code), meaning, tuple(k.strip("`") for k in kinds.split(", ") if k)) for code, meaning, kinds in
              [(r + [""])[:3] for r in rows]]
    assert readme == exit_codes()
    assert {c for c, _, _ in exit_codes()} == {c for c, _ in ERROR_KINDS.values()} | {0, 141}
    for code, _, kinds in exit_codes():  # a code without its own summary is one kind's
        assert code in (0, 1, 2, 141) or len(kinds) == 1, code


def test_readme_quiet_table_is_consoles():
    rows = _readme_rows("| command | `-q` leaves on stdout |")
    assert {c.strip("`"): what for c, what in rows} == {c: w for c, (w, _) in QUIET.items()}


def test_the_help_epilog_is_the_exit_code_table():
    text = run("--help").stdout
    for line in exit_code_lines():
        assert line.strip() in text, line
    assert len(exit_code_lines()) == len(exit_codes())


COMMAND_LINES = 50  # issue 60: a command parses, calls one function below it and renders


def command_lines(callback) -> int:
    """A command function's lines from its `def` to its end, its help (the docstring) left out:
    click's decorators and the help are the command's declaration, the rest is its code."""
    import ast
    import inspect
    import textwrap

    while hasattr(callback, "__wrapped__"):
        callback = callback.__wrapped__
    node = ast.parse(textwrap.dedent(inspect.getsource(callback))).body[0]
    doc = node.body[0] if ast.get_docstring(node) is not None else None
    return node.end_lineno - node.lineno + 1 - (doc.end_lineno - doc.lineno + 1 if doc else 0)


def every_command(group, prefix: str = "") -> Iterator[tuple[str, object]]:
    import click

    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from every_command(command, f"{prefix}{name} ")
        else:
            yield prefix + name, command.callback


def test_no_command_function_is_over_50_lines():
    lines = {name: command_lines(f) for name, f in every_command(cli)}
    assert set(ROWS) <= set(lines)
    assert {name: n for name, n in lines.items() if n > COMMAND_LINES} == {}


def test_the_line_count_reads_a_decorated_command():
    import click

    @click.command()
    @click.option("--x")
    def long(x):
        """Help.

        More help."""
        a = 1
        return a

    assert command_lines(long.callback) == 3
