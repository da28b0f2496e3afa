"""README.md and docs/ held to the code by the docs check (tools/docscheck): links, anchors, paths, ``file::test``
names, make targets, ``fanfold`` subcommands and options, FANFOLD_* variables, public names both ways, generated
blocks, figures and history outside them (less the visible debt of tools/docscheck/debt.txt), and every python
block run as written (``# not run: REASON`` skips one; ``# run: fanfold run -n N ...`` runs it in N processes)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from docscheck import check  # noqa: E402  (tools/ on the path first)


def _report(found) -> str:
    return "\n".join(str(f) for f in found) + "\n(python tools/docscheck prints the same)"


def test_pages_hold_to_the_code():
    found = check.static(ROOT) + check.undocumented(ROOT)
    found = check.apply_debt(found, check.read_debt(), check.DEBT.relative_to(ROOT).as_posix())
    assert found == [], _report(found)


@pytest.mark.timeout(900)
def test_python_blocks_run():
    found = check.run_snippets(ROOT, timeout=180)
    assert found == [], _report(found)
