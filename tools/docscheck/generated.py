"""Generated blocks: the only place a page holds measured figures.

A block is written by the command that measures it, between two marker lines::

    <!-- generated NAME: COMMAND | sha256:HASH -->
    ...the command's output: its numbers, with the date, the commit and the machine they were measured on...
    <!-- /generated NAME -->

HASH is the first 16 hex digits of the body's sha256, so the docs check tells a block the command wrote from one
edited by hand. ``write_block`` is what the commands call (standard library only: benchmarks and tests/ import it
by path); ``make docs-figures`` reruns every block's COMMAND.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

START = re.compile(r"^<!-- generated ([\w.-]+): (.+?) \| sha256:([0-9a-f]*) -->$")
END = "<!-- /generated {name} -->"
_ANY_START = re.compile(r"^<!-- generated\b")


@dataclass(frozen=True)
class Block:
    """A generated block of a page: its 1-based marker lines, name, command, recorded hash and body."""

    name: str
    command: str
    recorded: str
    body: str
    start: int
    end: int


def digest(body: str) -> str:
    return hashlib.sha256((body.strip() + "\n").encode()).hexdigest()[:16]


def blocks(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The page's blocks, and (line, problem) for markers that do not form one."""
    lines = text.split("\n")
    out, problems, i = [], [], 0
    while i < len(lines):
        m = START.match(lines[i])
        if not m:
            if _ANY_START.match(lines[i]):
                problems.append((i + 1, "a generated-block marker not of the form "
                                        "'<!-- generated NAME: COMMAND | sha256:HASH -->'"))
            elif lines[i].startswith("<!-- /generated"):
                problems.append((i + 1, "an end marker without its start"))
            i += 1
            continue
        end = END.format(name=m.group(1))
        try:
            j = lines.index(end, i + 1)
        except ValueError:
            problems.append((i + 1, f"generated block {m.group(1)!r} has no end marker {end!r}"))
            break
        out.append(Block(m.group(1), m.group(2), m.group(3), "\n".join(lines[i + 1:j]), i + 1, j + 1))
        i = j + 1
    return out, problems


def render(name: str, command: str, body: str) -> str:
    """The block's text, markers included, sealed with the body's hash."""
    body = body.strip("\n")
    return f"<!-- generated {name}: {command} | sha256:{digest(body)} -->\n{body}\n{END.format(name=name)}"


def write_block(page: Path, name: str, command: str, body: str) -> None:
    """Replace the block ``name`` of ``page`` with ``body`` made by ``command`` (a page without one gets it at the
    end)."""
    text = page.read_text(encoding="utf-8")
    new = render(name, command, body)
    found = [b for b in blocks(text)[0] if b.name == name]
    if found:
        lines = text.split("\n")
        text = "\n".join(lines[:found[0].start - 1] + [new] + lines[found[0].end:])
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    page.write_text(text, encoding="utf-8")
