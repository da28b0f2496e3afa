"""What a page says about the API and the CLI: every ``fanfold.name`` resolves, every ``fanfold COMMAND --flag``
parses; and every public name (``fanfold.__all__``) and every flag of every subcommand is on some page."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from dataclasses import dataclass

from .pages import Finding, Page, code_texts

_NAME = re.compile(r"(?<![\w./-])fanfold((?:\.[A-Za-z_]\w*)+)")
# the command word of a shell line: at its start, after a prompt, a venv's bin/, && or ;, or VAR=value
_COMMAND = re.compile(r"(?:^|\$ |bin/|&& |; |\b[A-Z_]+=\S* )fanfold\s+([a-z][\w-]*)(.*)")


def resolves(dotted: str) -> bool:
    """``fanfold.a.b`` names a module or an attribute reachable from one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("fanfold"):  # a module of fanfold's that needs an optional
                return True  # package (fanfold.integrations.lightning without lightning): it exists
            continue
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def public_names(page: Page) -> list[Finding]:
    """Every ``fanfold.x.y`` a page names, in prose or code, exists."""
    found, seen = [], {}
    for n, line in enumerate(page.lines, 1):
        for m in _NAME.finditer(line):
            dotted = "fanfold" + m.group(1).rstrip(".")
            if dotted.rsplit(".", 1)[-1] in ("md", "py", "pt", "json", "jsonl", "log", "txt", "png"):
                continue
            if dotted not in seen:
                seen[dotted] = resolves(dotted)
            if not seen[dotted]:
                found.append(Finding(page.name, n, f"{dotted}: fanfold has no such name"))
    return found


@dataclass(frozen=True)
class Option:
    """One option of a subcommand: its spellings, whether it takes a value, whether its help is suppressed."""

    strings: tuple[str, ...]
    takes_value: bool
    hidden: bool


def commands() -> dict[str, list[Option]]:
    """Every ``fanfold`` subcommand and its options, from the CLI's own parser."""
    from fanfold.cli import build_parser

    out = {}
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = [Option(tuple(a.option_strings), a.nargs != 0, a.help == argparse.SUPPRESS)
                             for a in sub._actions if a.option_strings]
    return out


def cli(page: Page, known: dict[str, list[Option]]) -> list[Finding]:
    """Every ``fanfold COMMAND [options]`` shown as code names a subcommand and options it has (the words after the
    first positional argument belong to the script)."""
    found = []
    for n, text in code_texts(page):
        for m in _COMMAND.finditer(text.strip()):
            command, rest = m.group(1), m.group(2).split("#")[0]
            if command not in known:
                found.append(Finding(page.name, n, f"fanfold {command}: no such subcommand "
                                                   f"(there are: {', '.join(known)})"))
                continue
            options = {s: o for o in known[command] for s in o.strings}
            try:
                words = shlex.split(re.split(r"[;|&]|\.\.\.", rest)[0])
            except ValueError:
                words = rest.split()
            i = 0
            while i < len(words):
                word = words[i]
                if not word.startswith("-") or word in ("-", "--"):
                    break
                flag = word.split("=")[0]
                if flag not in options:
                    found.append(Finding(page.name, n, f"fanfold {command} {flag}: no such option"))
                    break
                i += 2 if options[flag].takes_value and "=" not in word else 1
    return found


def undocumented(pages: list[Page], known: dict[str, list[Option]], public: list[str]) -> list[Finding]:
    """Every public name and every (visible) option of every subcommand appears on some page."""
    text = "\n".join(p.text for p in pages)
    found = [Finding("fanfold/__init__.py", 1, f"fanfold.{name} is public (in __all__) but no page names it")
             for name in public if not re.search(rf"(?<![\w.])fanfold\.{re.escape(name)}\b", text)]
    for command, options in known.items():
        if not re.search(rf"fanfold {command}\b", text):
            found.append(Finding("fanfold/cli", 1, f"fanfold {command}: no page documents this subcommand"))
        for o in options:
            if o.hidden or "-h" in o.strings:
                continue
            if not any(re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", text) for s in o.strings):
                found.append(Finding("fanfold/cli", 1, f"fanfold {command} {o.strings[-1]}: no page documents "
                                                       "this option"))
    return found
