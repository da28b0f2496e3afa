"""The cost of ``import fanfold`` against ``import torch``, each timed in fresh interpreters -> docs/benchmarks.md.

    .venv/bin/python benchmarks/import_cost.py              # 10 interpreters each; refreshes the page's block
    .venv/bin/python benchmarks/import_cost.py --runs 20 --no-page

Each interpreter times one import statement, interpreter start-up excluded: wall seconds (``time.perf_counter``,
what a user waits) and CPU seconds of the process (``time.process_time``, which other jobs on the machine move far
less), and reports how many modules it left in ``sys.modules``. The two imports take turns, the order flipped every
pair, so that a machine's load hits both alike; the figures are the medians over the interpreters, and the ratio is
fanfold's median over torch's (fanfold's import includes torch's; the target is at most 1.2, on the wall time),
with the median of the pairs' own ratios beside it. The fanfold imported is this
tree's ``src``. Before timing, one untimed interpreter of each warms the file cache and writes fanfold's bytecode
cache, which every installed package has (pip compiles it; torch ships it), even where
``PYTHONDONTWRITEBYTECODE`` is set: without it each interpreter would compile fanfold's sources again.

The page's generated block ``import-cost`` is this script's output; edit the
script, not the block.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
sys.path.insert(0, str(ROOT / "tools"))
from docscheck.generated import write_block  # noqa: E402  (tools/docscheck/generated.py: the sealed block)

TARGET = 1.2
ROWS = ("torch", "fanfold")

# What each fresh interpreter runs: one import, timed, and what it loaded.
CHILD = """
import json, sys, time
start, cpu = time.perf_counter(), time.process_time()
import {name}
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({{"seconds": seconds, "cpu": cpu, "modules": len(sys.modules), "file": {name}.__file__}}))
"""


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def one_import(name: str, env: dict[str, str], timeout: float) -> dict:
    """Wall and CPU seconds of ``import name`` in a fresh interpreter, the modules it left loaded, its file."""
    out = subprocess.run([sys.executable, "-c", CHILD.format(name=name)], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"`import {name}` failed in a fresh interpreter (exit {out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(runs: int, timeout: float) -> dict[str, list[dict]]:
    env = child_env()
    for name in ROWS:  # untimed: the file cache, and fanfold's bytecode cache
        one_import(name, env, timeout)
    found = one_import("fanfold", env, timeout)["file"]
    if not found.startswith(str(ROOT / "src")):
        raise RuntimeError(f"the interpreters import fanfold from {found}, not from this tree's src")
    results: dict[str, list[dict]] = {name: [] for name in ROWS}
    for i in range(runs):
        for name in (ROWS if i % 2 == 0 else ROWS[::-1]):
            results[name].append(one_import(name, env, timeout))
    return results


def _commit() -> str:
    """", on commit <short hash>" (" + changes" where src/ differs from it); "" where git cannot say."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "src")
    except (OSError, subprocess.SubprocessError):
        return ""
    return f", on commit {head}{' + changes' if dirty else ''}"


def block(results: dict[str, list[dict]], command: str, load: tuple[float, float]) -> str:
    import torch  # only for its version, after the timed interpreters

    runs = len(results["torch"])

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    ratio = median("fanfold", "seconds") / median("torch", "seconds")
    cpu_ratio = median("fanfold", "cpu") / median("torch", "cpu")
    pairs = statistics.median(f["seconds"] / t["seconds"] for f, t in zip(results["fanfold"], results["torch"]))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Run of {when}{_commit()}: `{command}`, torch {torch.__version__}, Python "
             f"{platform.python_version()}, {os.cpu_count()} CPUs, load average {load[0]:.1f} at the start and "
             f"{load[1]:.1f} at the end. {runs} fresh interpreters each, alternating; seconds of the import "
             "statement alone.", "",
             "| import | wall, median (s) | wall, min (s) | wall, max (s) | CPU, median (s) | modules loaded |",
             "|---|---|---|---|---|---|"]
    for name in ROWS:
        secs = [r["seconds"] for r in results[name]]
        lines.append(f"| `import {name}` | {median(name, 'seconds'):.3f} | {min(secs):.3f} | {max(secs):.3f} | "
                     f"{median(name, 'cpu'):.3f} | {median(name, 'modules'):.0f} |")
    lines += ["", f"fanfold / torch, wall: **{ratio:.2f}** (target at most {TARGET}: "
              f"{'met' if ratio <= TARGET else 'NOT met'}); median of the {runs} pairs' ratios {pairs:.2f}; "
              f"CPU: {cpu_ratio:.2f}."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="fresh interpreters per import (default 10)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one interpreter may take")
    p.add_argument("--no-page", action="store_true", help="print the block only; leave docs/benchmarks.md as it is")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be >= 1")
    command = "python benchmarks/import_cost.py" + (f" --runs {args.runs}" if args.runs != 10 else "")
    before = os.getloadavg()[0]
    results = measure(args.runs, args.timeout)
    text = block(results, command, (before, os.getloadavg()[0]))
    if not args.no_page:
        write_block(PAGE, "import-cost", command, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
