"""The whole docs check over a tree: every check on every page, then the debt list (debt.txt) taken off."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from . import figures, names, references, snippets
from .pages import Finding, Page, pages

DEBT = Path(__file__).with_name("debt.txt")
_DEBT_HEAD = """\
# Figures outside generated blocks, and history on pages, that the docs check still lets through: visible debt that
# only shrinks. An entry is `KIND PAGE:LINE: TEXT` and is matched by kind, page and text (the line is where it was
# when the list was written). Remove an entry when its page is fixed; `python tools/docscheck --write-debt` rewrites
# the list from the pages as they are (do that only to take entries off, never to add new debt).
"""


def static(root: Path, listed: list[Page] | None = None) -> list[Finding]:
    """Every check except running the snippets: fast, no subprocess."""
    listed = pages(root) if listed is None else listed
    by_path = {p.path.resolve(): p for p in listed}

    def anchors_of(path: Path) -> set[str]:
        page = by_path.get(path.resolve()) or Page.read(path, path.parent)
        return page.anchors()

    known = names.commands()
    found = []
    for page in listed:
        found += references.links(page, root, anchors_of)
        found += references.paths(page, root)
        found += references.make(page, root)
        found += references.environment(page, root)
        found += references.history(page)
        found += names.public_names(page)
        found += names.cli(page, known)
        found += figures.block_findings(page, root)
        found += figures.outside_blocks(page)
        found += snippets.collect(page)[1]
    return found


def undocumented(root: Path) -> list[Finding]:
    """Public names and CLI options that no page documents (only for the real tree: fixtures document little)."""
    import fanfold

    return names.undocumented(pages(root), names.commands(), list(fanfold.__all__))


def run_snippets(root: Path, timeout: float = 120, listed: list[Page] | None = None) -> list[Finding]:
    listed = pages(root) if listed is None else listed
    return snippets.run([s for p in listed for s in snippets.collect(p)[0]], root, timeout)


def read_debt(path: Path = DEBT) -> list[tuple[str, str, int, str]]:
    """(kind, page, line, text) of every debt entry."""
    out = []
    if path.exists():
        for raw in path.read_text(encoding="utf-8").splitlines():
            if raw.strip() and not raw.startswith("#"):
                kind, rest = raw.split(" ", 1)
                where, text = rest.split(": ", 1)
                page, line = where.rsplit(":", 1)
                out.append((kind, page, int(line), text))
    return out


def apply_debt(found: list[Finding], debt: list[tuple[str, str, int, str]], debt_name: str) -> list[Finding]:
    """The findings the debt list does not cover, and one finding per debt entry that no longer occurs."""
    left = Counter((kind, page, text) for kind, page, _, text in debt)
    out = []
    for f in found:
        k = (f.kind, f.page, f.key)
        if f.kind and left[k] > 0:
            left[k] -= 1
        else:
            out.append(f)
    for kind, page, line, text in debt:
        if left[(kind, page, text)] > 0:
            left[(kind, page, text)] -= 1
            out.append(Finding(debt_name, 1, f"debt entry '{kind} {page}:{line}: {text}' no longer occurs: remove it"))
    return out


def write_debt(found: list[Finding], path: Path = DEBT) -> None:
    entries = [f"{f.kind} {f.page}:{f.line}: {f.key}" for f in found if f.kind]
    path.write_text(_DEBT_HEAD + "".join(e + "\n" for e in entries), encoding="utf-8")
