"""Every ```python block of README.md runs, as written, in a fresh Python process.

Convention: a block whose first line is a comment starting with ``# not run`` (e.g. ``# not run: needs 2 GPUs`` or
``# not run: runs under fanfold run``) is skipped, and says why; every other ```python block must run on its own
(its imports included) in a fresh interpreter, in an empty temporary directory, within TIMEOUT seconds, and exit 0.
A block that shows a launch should do it through ``fanfold.launch`` with a module-level function of its own file
(fork is used for ``__main__`` functions, so that works), or be marked ``# not run``. Blocks of other languages
(```bash, ```text) are not run. The test ids are ``README.md:<line>`` so a failure points at the block.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180  # one block; a contended CI machine needs seconds just to import torch
SKIP = "# not run"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def blocks(path: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block of ``path``."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def _params():
    found = blocks(ROOT / "README.md")
    if not found:
        return [pytest.param(None, id="README.md:no-python-blocks")]
    return [pytest.param(code, id=f"README.md:{line}") for line, code in found]


def test_block_finder_reads_fences_and_lines(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("intro\n```python\nprint(1)\n```\ntext\n```bash\nls\n```\n```python\n# not run: x\n```\n")
    assert blocks(md) == [(2, "print(1)\n"), (9, "# not run: x\n")]


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("code", _params())
def test_readme_block_runs(code, tmp_path):
    if code is None:
        pytest.skip("README.md has no ```python block")
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    if first.startswith(SKIP):
        pytest.skip(first)
    src = str(ROOT / "src")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    (tmp_path / "block.py").write_text(code)
    res = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert res.returncode == 0, (f"exit {res.returncode}\n--- stdout\n{res.stdout[-3000:]}\n"
                                 f"--- stderr\n{res.stderr[-3000:]}")


def test_blocks_write_only_in_their_own_directory():
    # each block runs in an empty temporary directory that the test removes; an absolute path would outlive it
    absolute = [(line, m.group(0)) for line, code in blocks(ROOT / "README.md")
                for m in re.finditer(r"""["'](/tmp|/var|~)/[^"']*["']""", code)]
    assert absolute == [], f"README.md blocks write outside their directory: {absolute}"
