"""`fanfold run` refuses a target that cannot start before any worker does: a missing script, a directory, a syntax
error, a module that is not found, and finds modules without running any package's ``__init__``. The oracle is the
plain interpreter: what ``python SCRIPT`` / ``python -m MODULE`` say about the same targets."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fanfold.launcher.agent import check_module, check_script


def _python(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60)


@pytest.fixture
def tree(tmp_path, monkeypatch):
    (tmp_path / "ok.py").write_text("print('ok')\n")
    (tmp_path / "bad.py").write_text("x = 1\ndef f(:\n    pass\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("print('app')\n")
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    # importing pkg would leave a mark: the check must find pkg.sub.train without it
    (pkg / "__init__.py").write_text("open('imported', 'w').close()\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "train.py").write_text("print('train')\n")
    (pkg / "sub" / "broken.py").write_text("if True\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_scripts(tree):
    check_script("ok.py")
    check_script("app")  # python runs a directory's __main__.py
    assert _python(tree, "app").returncode == 0
    with pytest.raises(ValueError, match=r"^script not found: 'missing\.py'$"):
        check_script("missing.py")
    with pytest.raises(ValueError, match=r"^script 'folder' is a directory without a __main__\.py"):
        check_script("folder")
    assert _python(tree, "folder").returncode != 0
    with pytest.raises(ValueError, match=r"^script 'bad\.py' does not compile: SyntaxError: .* \(line 2: 'def f\(:'\)"):
        check_script("bad.py")
    assert "SyntaxError" in _python(tree, "bad.py").stderr


def test_modules_are_found_without_running_them(tree):
    check_module("pkg.sub.train")
    check_module("json.tool")  # the standard library, as python -m finds it
    assert not (tree / "imported").exists(), "the check ran pkg/__init__.py"
    with pytest.raises(ValueError, match=r"^module not found: 'no_such_module'; run from the directory"):
        check_module("no_such_module")
    assert "No module named no_such_module" in _python(tree, "-m", "no_such_module").stderr
    with pytest.raises(ValueError, match=r"^module not found: 'pkg\.nope\.x' \(package 'pkg' has no 'nope'\)"):
        check_module("pkg.nope.x")
    with pytest.raises(ValueError, match=r"^module 'pkg\.sub' is a package without a __main__ module"):
        check_module("pkg.sub")
    with pytest.raises(ValueError, match=r"^module 'pkg\.sub\.broken' \(.*broken\.py\) does not compile: SyntaxError"):
        check_module("pkg.sub.broken")
    with pytest.raises(ValueError, match=r"^module 'x-y' is not a dotted Python name"):
        check_module("x-y")


@pytest.mark.parametrize("argv, message", [
    (["-m", "no_such_module"], "fanfold run: error: module not found: 'no_such_module'"),
    (["bad.py"], "fanfold run: error: script 'bad.py' does not compile: SyntaxError"),
    (["folder"], "fanfold run: error: script 'folder' is a directory without a __main__.py"),
])
def test_fanfold_run_refuses_before_any_worker_starts(tree, argv, message):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    res = subprocess.run([sys.executable, "-m", "fanfold", "run", "-n", "2", *argv], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines()[-1].startswith(message), res.stderr
    assert "Traceback" not in res.stderr and "frozen runpy" not in res.stderr
    assert not (tree / "imported").exists()
