"""Which tests of torch's ``DistributedTest._DistTestBase`` the conformance run takes: the DDP-related ones.

Read from the source of torch's installed ``distributed_test.py`` with ``ast`` (no import: importing it needs the
``BACKEND`` environment and takes seconds). The rule, applied to every ``test_*`` method of ``_DistTestBase``:

1. its name mentions DDP: ``ddp`` or ``DistributedDataParallel`` / ``distributed_data_parallel`` (any case); or
2. it constructs DDP: its body, or the body of a ``self._helper(...)`` it calls (followed transitively through the
   class's own helpers), contains a call whose callee is named ``DistributedDataParallel`` (bare, or as the last
   part of a dotted name such as ``torch.nn.parallel.DistributedDataParallel``).

Layer: a tool beside the package (``conformance/``), imported by ``driver.py`` and ``run.py``; imports no fanfold.
"""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

__all__ = ["suite_path", "ddp_tests", "NAME_RULE"]

NAME_RULE = re.compile(r"ddp|distributed_?data_?parallel", re.IGNORECASE)
_MODULE = "torch.testing._internal.distributed.distributed_test"


def suite_path() -> Path:
    """The installed ``distributed_test.py`` (found without importing it)."""
    spec = importlib.util.find_spec(_MODULE.rsplit(".", 1)[0])
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"cannot find {_MODULE}: is torch installed in this interpreter?")
    path = Path(list(spec.submodule_search_locations)[0]) / "distributed_test.py"
    if not path.is_file():
        raise RuntimeError(f"{path} does not exist: this torch build ships no distributed test suite")
    return path


def _test_base(tree: ast.Module) -> ast.ClassDef:
    for outer in tree.body:
        if isinstance(outer, ast.ClassDef) and outer.name == "DistributedTest":
            for inner in outer.body:
                if isinstance(inner, ast.ClassDef) and inner.name == "_DistTestBase":
                    return inner
    raise RuntimeError("distributed_test.py has no class DistributedTest._DistTestBase")


def _callee_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _self_calls(fn: ast.FunctionDef) -> set[str]:
    """Names of the methods that ``fn`` calls as ``self.name(...)``."""
    return {c.func.attr for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and isinstance(c.func.value, ast.Name) and c.func.value.id == "self"}


def _constructs_ddp(fn: ast.FunctionDef) -> bool:
    return any(isinstance(c, ast.Call) and _callee_name(c) == "DistributedDataParallel" for c in ast.walk(fn))


def ddp_tests(path: Path | None = None) -> list[str]:
    """The sorted names of the DDP-related ``test_*`` methods of ``_DistTestBase`` (rule in the module docstring)."""
    tree = ast.parse((path or suite_path()).read_text())
    methods = {f.name: f for f in _test_base(tree).body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    memo: dict[str, bool] = {}

    def reaches_ddp(name: str, seen: frozenset) -> bool:
        if name not in memo:
            fn = methods[name]
            memo[name] = _constructs_ddp(fn) or any(
                reaches_ddp(h, seen | {name}) for h in sorted(_self_calls(fn))
                if h in methods and h.startswith("_") and h not in seen)
        return memo[name]

    return sorted(n for n in methods if n.startswith("test_")
                  and (NAME_RULE.search(n) or reaches_ddp(n, frozenset())))
