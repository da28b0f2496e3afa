"""``python tools/docscheck [--no-snippets] [--write-debt]``: print every finding as PAGE:LINE: MESSAGE, exit 1 if
there is one. ``--rerun-figures`` (``make docs-figures``) first reruns the command of every generated block."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from docscheck import check, generated  # noqa: E402  (after the path it is found on)
from docscheck.pages import pages  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def rerun_figures() -> int:
    """Run each generated block's command once (``python`` is this interpreter), from the root; each rewrites its
    own blocks. Returns the number of commands that failed."""
    commands = dict.fromkeys(b.command for p in pages(ROOT) for b in generated.blocks(p.text)[0])
    failed = 0
    for command in commands:
        words = shlex.split(command)
        words = [sys.executable if w == "python" else w for w in words]
        print(f"docs-figures: {command}", flush=True)
        if subprocess.run(words, cwd=ROOT).returncode != 0:
            print(f"docs-figures: FAILED: {command}", flush=True)
            failed += 1
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-snippets", action="store_true", help="skip running the python blocks")
    p.add_argument("--write-debt", action="store_true", help="rewrite debt.txt from the pages as they are")
    p.add_argument("--timeout", type=float, default=120, help="seconds one python block may take")
    p.add_argument("--rerun-figures", action="store_true", help="rerun every generated block's command first")
    args = p.parse_args()
    if args.rerun_figures and rerun_figures():
        return 1
    found = check.static(ROOT) + check.undocumented(ROOT)
    if args.write_debt:
        check.write_debt(found)
    found = check.apply_debt(found, check.read_debt(), check.DEBT.relative_to(ROOT).as_posix())
    if not args.no_snippets:
        found += check.run_snippets(ROOT, args.timeout)
    for f in found:
        print(f)
    print(f"docscheck: {len(found)} finding(s)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
