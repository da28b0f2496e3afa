"""A markdown page as the checks see it: its lines, its fenced blocks, its code spans and its headings' anchors."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
_SPAN = re.compile(r"(`+)(.+?)\1")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Finding:
    """One thing a page says that does not hold: where (page relative to the root, 1-based line) and what."""

    page: str
    line: int
    message: str
    kind: str = ""  # "figure" or "history": may stand in the debt list (debt.txt), matched by page and ``key``
    key: str = ""

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.message}"


@dataclass(frozen=True)
class Fence:
    """A fenced block: the line of its opening fence, its language tag ('' if none) and its body."""

    line: int
    lang: str
    body: str


@dataclass
class Page:
    """One markdown file: ``name`` is its path relative to the repository root, as findings print it."""

    path: Path
    name: str
    text: str
    lines: list[str] = field(init=False)
    in_fence: list[str | None] = field(init=False)  # per line: the enclosing fence's language, None outside
    fences: list[Fence] = field(init=False)

    def __post_init__(self) -> None:
        self.lines = self.text.split("\n")
        self.in_fence, self.fences = [], []
        opener, lang, start, body = None, "", 0, []
        for i, line in enumerate(self.lines):
            m = _FENCE.match(line)
            if opener is None and m:
                opener, lang, start, body = m.group(1), m.group(2).lower(), i + 1, []
                self.in_fence.append(lang)
            elif opener is not None and line.strip().startswith(opener) and not line.strip().strip(opener[0]):
                self.fences.append(Fence(start, lang, "\n".join(body) + "\n"))
                self.in_fence.append(lang)
                opener = None
            else:
                if opener is not None:
                    body.append(line)
                self.in_fence.append(lang if opener is not None else None)

    @classmethod
    def read(cls, path: Path, root: Path) -> Page:
        return cls(path, path.relative_to(root).as_posix(), path.read_text(encoding="utf-8"))

    def prose(self):
        """(line number, line) of every line outside fenced blocks."""
        return ((i + 1, line) for i, line in enumerate(self.lines) if self.in_fence[i] is None)

    def anchors(self) -> set[str]:
        """The anchors GitHub gives this page's headings (lower case, punctuation dropped, spaces to '-', -1, -2...
        for repeats)."""
        seen: dict[str, int] = {}
        out = set()
        for _, line in self.prose():
            m = _HEADING.match(line)
            if not m:
                continue
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2))
            slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
        return out


def code_spans(line: str) -> list[str]:
    """The inline code spans of one line of prose."""
    return [m.group(2).strip() for m in _SPAN.finditer(line)]


def without_code_spans(line: str) -> str:
    """The line with each code span blanked (same length, so columns still match)."""
    return _SPAN.sub(lambda m: " " * len(m.group(0)), line)


def code_texts(page: Page):
    """(line number, text) of everything a page shows as code: each code span and each line of a fenced block."""
    for i, line in enumerate(page.lines):
        if page.in_fence[i] is not None:
            if not _FENCE.match(line):
                yield i + 1, line
        else:
            for span in code_spans(line):
                yield i + 1, span


def pages(root: Path) -> list[Page]:
    """README.md and every docs/*.md, in a stable order."""
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [Page.read(p, root) for p in paths if p.exists()]
