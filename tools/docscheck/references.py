"""What a page points at in the tree: links and their anchors, paths and ``file::test`` names, make targets and
FANFOLD_* environment variables; and words that tell the work's history instead of the product."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from .pages import Finding, Page, code_texts, without_code_spans

_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_PATH = re.compile(r"(?<![\w./~-])((?:src|tests|examples|benchmarks|conformance|docs|tools|\.ci)/[\w./*-]*[\w*/])"
                   r"((?:::[\w\[\]-]+)*)")
_MAKE = re.compile(r"(?:^|[\s;&(])make\s+(?:-\S+\s+)*([a-z][\w-]*)")
_ENV = re.compile(r"\bFANFOLD_[A-Z0-9_]+\b")
_HISTORY = re.compile(r"round [0-9]|the issue's|issue [0-9]+", re.I)
_ENV_SOURCES = ("src", "tests", "benchmarks", "conformance", "Makefile")


def links(page: Page, root: Path, anchors_of) -> list[Finding]:
    """Every relative link resolves to a file of the tree, and its #anchor to a heading of that page."""
    found = []
    for n, line in page.prose():
        for m in _LINK.finditer(without_code_spans(line)):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.path.parent / path).resolve() if path else page.path
            if path and not dest.exists():
                found.append(Finding(page.name, n, f"link {target!r}: {path} does not exist"))
            elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
                found.append(Finding(page.name, n, f"link {target!r}: no heading of {dest.name} has the anchor "
                                                   f"#{anchor}"))
    return found


@cache
def _names_in(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return frozenset(node.name for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


def paths(page: Page, root: Path) -> list[Finding]:
    """Every path of the tree a page names (src/, tests/, examples/, benchmarks/, ...; a glob matches something), and
    every ``file::name`` names a test function or class of that file."""
    found = []
    for n, line in enumerate(page.lines, 1):
        for m in _PATH.finditer(line):
            rel, names = m.group(1).rstrip("."), m.group(2)
            hits = list(root.glob(rel.rstrip("/"))) if "*" in rel else [root / rel]
            if not hits or not hits[0].exists():
                found.append(Finding(page.name, n, f"path {rel} does not exist"))
                continue
            for name in filter(None, names.split("::")):
                bare = name.split("[")[0]
                if hits[0].suffix == ".py" and bare not in _names_in(hits[0]):
                    found.append(Finding(page.name, n, f"{rel}::{name}: {rel} has no test or class {bare}"))
    return found


@cache
def make_targets(root: Path) -> frozenset[str]:
    text = (root / "Makefile").read_text(encoding="utf-8")
    return frozenset(m.group(1) for m in re.finditer(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


def make(page: Page, root: Path) -> list[Finding]:
    """Every ``make TARGET`` shown as code is a target of the Makefile."""
    targets = make_targets(root)
    return [Finding(page.name, n, f"make {m.group(1)}: the Makefile has no target {m.group(1)!r}")
            for n, text in code_texts(page) for m in _MAKE.finditer(text) if m.group(1) not in targets]


@cache
def _code_text(root: Path) -> str:
    parts = []
    for name in _ENV_SOURCES:
        p = root / name
        files = [p] if p.is_file() else sorted(p.rglob("*.py")) if p.is_dir() else []
        parts += [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return "\n".join(parts)


def environment(page: Page, root: Path) -> list[Finding]:
    """Every FANFOLD_* variable a page names is read somewhere in the code."""
    code = _code_text(root)
    return [Finding(page.name, n, f"environment variable {m.group(0)}: no code reads it")
            for n, line in enumerate(page.lines, 1) for m in _ENV.finditer(line)
            if not re.search(rf"\b{m.group(0)}\b", code)]


def history(page: Page) -> list[Finding]:
    """A page describes the product as it is: rounds and issue numbers belong in commit messages."""
    return [Finding(page.name, n, f"history on a page: {m.group(0)!r} (say what is, or move it to a commit message)",
                    "history", m.group(0).lower())
            for n, line in enumerate(page.lines, 1) for m in _HISTORY.finditer(line)]
