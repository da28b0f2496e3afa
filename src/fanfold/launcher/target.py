"""What ``fanfold run`` checks before any worker starts: the script exists, is runnable and compiles; or the module
(``-m``) is found, as a worker would find it, without running any of the user's code.

A worker takes seconds to start (torch's agent, then the interpreter); a typo in a file or module name, or a syntax
error, should cost none of them and read as one line, not as N tracebacks through ``<frozen runpy>``.
"""
from __future__ import annotations

import importlib.machinery
import os
import sys

__all__ = ["check_script", "check_module"]


def _compiles(path: str, what: str) -> None:
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        raise ValueError(f"{what} cannot be read: {exc.strerror}") from None
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:  # IndentationError too
        where = f"line {exc.lineno}" + (f": {exc.text.strip()!r}" if exc.text and exc.text.strip() else "")
        raise ValueError(f"{what} does not compile: {type(exc).__name__}: {exc.msg} ({where})") from None
    except ValueError as exc:  # null bytes in the source
        raise ValueError(f"{what} does not compile: {exc}") from None


def check_script(script: str) -> None:
    """ValueError unless ``python script`` could start: a Python file that compiles, or a directory or zip file
    with a ``__main__.py`` (as ``python`` itself accepts)."""
    if not os.path.exists(script):
        raise ValueError(f"script not found: {script!r}")
    if os.path.isdir(script):
        main = os.path.join(script, "__main__.py")
        if not os.path.isfile(main):
            raise ValueError(f"script {script!r} is a directory without a __main__.py: give the Python file to run "
                             f"(or the package with -m)")
        _compiles(main, f"script {main!r}")
        return
    if not os.path.isfile(script):
        raise ValueError(f"script {script!r} is not a regular file")
    with open(script, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    if not zipped:  # a zip application is checked by the interpreter that opens it
        _compiles(script, f"script {script!r}")


def _find(name: str, path: list[str] | None):
    """The spec of ``name`` (dotted, its parent already found) without importing anything: the path finder over
    ``path``, then any other finder installed on ``sys.meta_path`` (an editable install's, for example)."""
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None:
        return spec
    if "." not in name:
        for finder in sys.meta_path:
            if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec(name, None)
            except Exception:  # a third-party finder that cannot answer without importing: not ours to judge
                continue
            if spec is not None:
                return spec
    return None


def check_module(module: str) -> None:
    """ValueError unless ``python -m module`` could start from this directory: every part of the dotted name is
    found (no package's ``__init__`` is run), a package has a ``__main__``, and a source file compiles."""
    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ValueError(f"module {module!r} is not a dotted Python name (to run a file, leave -m out)")
    # a worker runs with the current directory first on sys.path (python -m's rule), then the rest of ours
    search: list[str] | None = [os.getcwd(), *sys.path[1:]]
    spec = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        spec = _find(name, search)
        if spec is None:
            where = "" if i == 0 else f" (package {'.'.join(parts[:i])!r} has no {parts[i]!r})"
            raise ValueError(f"module not found: {module!r}{where}; run from the directory that holds it, or "
                             f"put that directory on PYTHONPATH")
        search = list(spec.submodule_search_locations or [])
        if i < len(parts) - 1 and spec.submodule_search_locations is None:
            raise ValueError(f"module not found: {module!r} ({name!r} is a module, not a package)")
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        main = _find(f"{module}.__main__", search)
        if main is None:
            raise ValueError(f"module {module!r} is a package without a __main__ module: python -m cannot run it")
        spec = main
    if spec.origin and spec.origin.endswith(".py") and os.path.isfile(spec.origin):
        _compiles(spec.origin, f"module {spec.name!r} ({spec.origin})")
