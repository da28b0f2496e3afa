"""Every ```python block of a page runs as written, in an empty directory, unless its first line says otherwise:

- ``# not run: REASON`` skips it (the reason is required: a fragment, a notebook, a checkpoint file it needs, ...);
- ``# run: fanfold run -n N ...`` runs it in N processes under ``fanfold.launch`` (the launcher's environment, one
  process group per run), as the command on that line would.

All blocks run in one interpreter that imports torch once and forks a child per block (``_runner.py``), so the
check costs one torch import, not one per block.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .pages import Finding, Page

SKIP = re.compile(r"^#\s*not run\b:?\s*(.*)$")
LAUNCH = re.compile(r"^#\s*run:\s*fanfold run\s+(?:-n|--nproc-per-node|--nproc_per_node)[ =](\d+)\b")
_RUNNER = Path(__file__).with_name("_runner.py")


@dataclass(frozen=True)
class Snippet:
    """One python block to run: where it is, its code, how many processes (0: a plain script)."""

    page: str
    line: int
    code: str
    nprocs: int


def collect(page: Page) -> tuple[list[Snippet], list[Finding]]:
    """The page's blocks to run, and findings for blocks skipped without a reason."""
    runs, found = [], []
    for fence in page.fences:
        if fence.lang not in ("python", "py"):
            continue
        first = fence.body.lstrip().split("\n", 1)[0].strip()
        skip, launch = SKIP.match(first), LAUNCH.match(first)
        if skip:
            if not skip.group(1).strip():
                found.append(Finding(page.name, fence.line, "'# not run' without a reason: say why it cannot run"))
        else:
            runs.append(Snippet(page.name, fence.line, fence.body, int(launch.group(1)) if launch else 0))
    return runs, found


def run(snippets: list[Snippet], root: Path, timeout: float) -> list[Finding]:
    """Run every snippet (``timeout`` seconds each); a finding for each one that failed, with its output's tail."""
    if not snippets:
        return []
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root / "src"), os.environ.get("PYTHONPATH")) if p)
    request = json.dumps({"timeout": timeout, "snippets": [asdict(s) for s in snippets]})
    done = subprocess.run([sys.executable, str(_RUNNER)], input=request, capture_output=True, text=True, env=env,
                          timeout=60 + timeout * len(snippets))
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[(r["page"], r["line"])] = r
    found = []
    for s in snippets:
        r = results.get((s.page, s.line))
        if r is None:
            found.append(Finding(s.page, s.line, f"python block not run: the runner stopped "
                                                 f"(exit {done.returncode}): {done.stderr[-1500:]}"))
        elif not r["ok"]:
            found.append(Finding(s.page, s.line, f"python block fails: {r['error']}"))
    return found
