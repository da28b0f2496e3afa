"""Measured figures live only in generated blocks: each block is sealed and says when, on which commit and on what
machine it was measured; a figure in the prose outside them is a finding.

A figure is a number with a unit of time (ns, us, ms, s, seconds, minutes, hours), a ratio (``1.38x``), a share
(``%``), a memory size (B, KB, MB, GB, KiB, MiB, GiB) or a count of tests, runs or trials (``12 passed``). Not
figures: anything in a code span or in a fenced block of code (python, bash, ...: a setting such as ``timeout=120``
or ``1 << 20`` is code), and a number that a setting word shortly before it makes a setting rather than a
measurement (default, timeout, target, limit, at most, up to, every, after, within, threshold, budget)."""
from __future__ import annotations

import re
from pathlib import Path

from .generated import blocks, digest
from .pages import Finding, Page, without_code_spans

_CODE_LANGS = {"python", "py", "bash", "sh", "shell", "console", "toml", "yaml", "make", "makefile", "json", "diff"}
_NUMBER = r"(?<![\w.,/:#-])\d+(?:[.,]\d+)*(?:\s?-\s?\d+(?:\.\d+)?)?"
_FIGURE = re.compile(_NUMBER + r"(?:(?:x|×|%)(?!\w)|\s?(?:ns|us|µs|ms|s|KB|kB|MB|GB|TB|KiB|MiB|GiB|TiB)\b|"
                     r"\s(?:seconds?|minutes?|hours?|bytes|tests|passed|failed|skipped|errors|trials|runs)\b)")
_SETTING = re.compile(r"\b(default|defaults|timeout|target|limit|at most|up to|every|after|within|threshold|"
                      r"budget)\b[^.;:]{0,24}$", re.I)
_WHEN = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
_COMMIT = re.compile(r"\bcommit [0-9a-f]{7,40}\b")
_MACHINE = re.compile(r"\b(CPUs?|cores?|GPUs?|H100|H200|machine)\b", re.I)


def block_findings(page: Page, root: Path) -> list[Finding]:
    """Each generated block is well formed, sealed with its body's hash, dated, on a commit, on a named machine, and
    its command's script exists."""
    found_blocks, problems = blocks(page.text)
    found = [Finding(page.name, n, msg) for n, msg in problems]
    for b in found_blocks:
        where = f"generated block {b.name!r}"
        if b.recorded != digest(b.body):
            found.append(Finding(page.name, b.start, f"{where} was edited by hand (its sha256 does not match): rerun "
                                                     f"`{b.command}` (or make docs-figures), do not edit it"))
        for pattern, what in ((_WHEN, "the date (YYYY-MM-DD)"), (_COMMIT, "the commit ('commit abc1234')"),
                              (_MACHINE, "the machine (its CPUs, cores or GPU)")):
            if not pattern.search(b.body):
                found.append(Finding(page.name, b.start, f"{where} does not say {what} beside its numbers"))
        scripts = [w for w in b.command.split() if w.endswith(".py")]
        if not scripts or not (root / scripts[0]).exists():
            found.append(Finding(page.name, b.start, f"{where}: its command {b.command!r} names no script of the tree"))
    return found


def outside_blocks(page: Page) -> list[Finding]:
    """Every measured figure of the page that is not inside a generated block."""
    inside = set()
    for b in blocks(page.text)[0]:
        inside.update(range(b.start, b.end + 1))
    found = []
    for n, line in enumerate(page.lines, 1):
        lang = page.in_fence[n - 1]
        if n in inside or (lang is not None and lang in _CODE_LANGS) or line.startswith("<!--"):
            continue
        text = re.sub(r"\]\([^)]*\)", "]", without_code_spans(line))  # link targets are not prose
        for m in _FIGURE.finditer(text):
            if _SETTING.search(text[:m.start()]):
                continue
            figure = m.group(0)
            found.append(Finding(page.name, n, f"measured figure {figure!r} outside a generated block: move it "
                                               "into one (a command writes it) or point at the block",
                                 "figure", figure))
    return found
