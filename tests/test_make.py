"""The Makefile's targets that remove folders (issue 53): `make demo` and `make clean` remove DEMO only when make
demo made it (the quickstart's own demo/ is a user's), and `make wheel` leaves DIST as it was when the build
fails (a Python 3.12 venv has no setuptools for --no-build-isolation); and `make test` runs every suite."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args, f"PY={sys.executable}"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_make_demo_and_clean_leave_a_folder_they_did_not_make(tmp_path):
    demo = tmp_path / "demo"
    (demo / "model").mkdir(parents=True)  # the quickstart's: lucifer-shard synth dspark demo/model
    (demo / "model" / "config.json").write_text("{}")
    for target in ("demo", "clean"):
        r = make(target, f"DEMO={demo}")
        assert r.returncode != 0 and f"{demo}/ holds files make demo did not write (model )" in r.stderr, r.stderr
        assert (demo / "model" / "config.json").read_text() == "{}"


def test_make_clean_removes_the_demo_make_demo_made(tmp_path):
    """The mark make demo writes first is what lets it (and clean) remove the folder again; clean here runs only
    on DEMO (the other folders it removes are the clone's build products, none in this test's clone)."""
    demo = tmp_path / "demo"
    (demo / "out").mkdir(parents=True)
    (demo / ".made-by-make-demo").write_text("")
    makefile = (REPO / "Makefile").read_text()
    assert "mkdir -p $(DEMO) && : > $(DEMO_MARK)" in makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    r = subprocess.run(["make", "-s", "-n", "clean", f"DEMO={demo}"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and f"rm -rf {demo} " in r.stdout, r.stdout + r.stderr


def test_make_wheel_that_cannot_build_leaves_dist_as_it_was(tmp_path):
    """No setuptools (a stand-in module that fails to import) and no package index to fetch it from: the build
    fails, DIST keeps its wheel, no half-built folder is left beside it."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "setuptools.py").write_text("raise ImportError('no setuptools here (a test stand-in)')\n")
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "kept.whl").write_text("an earlier wheel")
    r = make("wheel", f"DIST={dist}", env={"PYTHONPATH": str(shadow), "PIP_CONFIG_FILE": os.devnull,
                                           "PIP_NO_INDEX": "1"})
    assert r.returncode != 0, r.stdout
    assert [p.name for p in dist.iterdir()] == ["kept.whl"] and not (tmp_path / "dist.new").exists()


def test_make_test_runs_every_suite_and_ends_with_each_ones_result(tmp_path):
    """A failed suite does not hide the others (issue 60): each runs, and the last lines say each one's result;
    the exit status is non-zero. The suites here are two stand-in targets (MAKEFILES reaches every sub-make)."""
    suites = tmp_path / "suites.mk"
    suites.write_text("fake-fail:\n\t@echo running fake-fail; exit 3\nfake-pass:\n\t@echo running fake-pass\n")
    r = make("test", "SUITES=fake-fail fake-pass", env={"MAKEFILES": str(suites)})
    assert r.returncode != 0 and "running fake-fail" in r.stdout and "running fake-pass" in r.stdout, r.stdout + r.stderr
    last = r.stdout.splitlines()[-3:]
    assert last[0] == "make test, each suite:", last
    assert last[1].startswith("fake-fail: FAILED in ") and last[2].startswith("fake-pass: passed in "), last
