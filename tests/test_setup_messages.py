"""What a new user sees first: `make run` and `make test` say what they are doing and for about how long before the
silent parts (the venv build, the test suite), import-linter's banner stays quiet, and the torch that pyproject.toml
declares is the torch the tests run on. Checked on `make -n` (what make would run, in order), nothing built."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _dry_run(target: str, tmp_path: Path) -> list[str]:
    # a venv path that does not exist: make plans the one-time set-up as on a fresh clone, and builds nothing
    res = subprocess.run(["make", "-n", "--no-print-directory", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def test_first_make_run_says_the_set_up_is_running_and_how_long(tmp_path):
    lines = _dry_run("run", tmp_path)
    venv = next(i for i, ln in enumerate(lines) if " -m venv " in ln)
    said = [ln for ln in lines[:venv] if ln.startswith("echo ")]
    assert len(said) == 1 and "one-time set-up" in said[0], lines
    assert re.search(r"about \d+-\d+ minutes", said[0]), said[0]
    assert lines[-1].endswith("/bin/fanfold train")


def test_make_test_says_how_long_and_import_linter_is_quiet(tmp_path):
    lines = _dry_run("test", tmp_path)
    lint = next(ln for ln in lines if "lint-imports" in ln)
    assert "--no-logo" in lint.split()
    pytest_at = next(i for i, ln in enumerate(lines) if "-m pytest" in ln)
    assert "minutes" in lines[pytest_at - 1] and lines[pytest_at - 1].startswith("echo "), lines
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"`make test` prints pytest's dots for about \d+-\d+ minutes", readme)


def _lowest(spec: str, name: str) -> tuple[int, ...]:
    m = re.search(rf"\b{name}\s*>=\s*([0-9.]+)", spec)
    assert m, f"no lower bound for {name} in {spec!r}"
    return tuple(int(x) for x in m.group(1).split("."))


def test_declared_torch_is_the_tested_torch():
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*)\]$", pyproject, re.M).group(1)
    pinned = re.search(r"^torch==([0-9.]+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    tested = tuple(int(x) for x in pinned.split("."))[:2]
    # CI runs the pinned torch only: the lowest version declared must be that one, not an untested older one
    assert _lowest(deps, "torch") == tested, (deps, pinned)
