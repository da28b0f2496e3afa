"""docs/conformance.md from the two runs' outcomes and the investigated reasons (``reasons.py``).

Layer: a tool beside the package, called by ``run.py``.
"""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from backend_report import summary_lines
from reasons import INTERNAL, REASONS

__all__ = ["Outcome", "write_page", "error_lines", "revision"]

STATUSES = ("pass", "fail", "timeout", "skip")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Failure|Interrupt|Timeout)\b):?\s?(.*)$")


@dataclass
class Outcome:
    """One test's result under one DDP: pass, fail, timeout or skip; ``detail`` is the traceback or skip reason."""
    test: str
    status: str
    seconds: float
    detail: str

    @classmethod
    def from_record(cls, record: dict) -> Outcome:
        return cls(record["test"], record["status"], record["seconds"], record["detail"])

    def as_record(self) -> dict:
        return asdict(self)


def error_lines(detail: str) -> list[str]:
    """What each rank raised, from the harness's report: its first exception line (the root cause of a chain) and,
    when different, its last ("cause -> final"); the report's own lines when it has no per-rank part."""
    blocks = re.split(r"Process \d+ exited with error code \d+ and exception:\n", detail)
    found = []
    for block in blocks[1:] or blocks:
        hits = [m.group(0).strip() for m in map(_EXCEPTION.match, block.splitlines()) if m]
        line = hits[0] if len(hits) < 2 or hits[0] == hits[-1] else f"{hits[0]} -> {hits[-1]}"
        if hits and line not in found:
            found.append(line)
    return found


def _cell(outcome: Outcome | None, why: bool = False) -> str:
    """The result as a table cell; with ``why``, a skip also says why (the first line of its reason)."""
    if outcome is None:
        return "not run"
    if outcome.status == "skip" and why and outcome.detail.strip():
        return "skip: " + _md(outcome.detail.strip().splitlines()[0][:80])
    return {"pass": "pass", "fail": "**FAIL**", "timeout": "**TIMEOUT**", "skip": "skip"}[outcome.status]


def _reason(test: str, torch_o: Outcome | None, fanfold_o: Outcome | None) -> str:
    if test in REASONS:
        return REASONS[test]
    if test in INTERNAL:
        return f"reads torch's internals: {INTERNAL[test]}"
    if fanfold_o is not None and fanfold_o.status in ("fail", "timeout"):
        lines = error_lines(fanfold_o.detail)
        return "not investigated yet: " + (_md(lines[0][:200]) if lines else fanfold_o.status)
    return "not investigated yet"


HOW_TO_RUN = [
    "- `make conformance` (`python conformance/run.py`): select, check the patching, run both ways, write this page. "
    "`--only TEST ...` runs some tests; `--report-only` rewrites the page from the last results (after editing "
    "`conformance/reasons.py`); `FANFOLD_TRANSPORT=torch make conformance` runs fanfold over gloo instead of shared "
    "memory.",
    "- Raw results and logs: `build/conformance/` (`torch.jsonl`, `fanfold.jsonl` with each test's traceback; "
    "`*.log` with the ranks' output), not in git.",
    "- Rank processes are forked from a forkserver that imported torch and the suite once (`--start-method "
    "forkserver`, the default); `--start-method spawn` starts each rank as torch's own driver does, a fresh "
    "interpreter per rank and test, which on 2 cores costs 5 to 15 s of imports per test, skipped ones included.",
    "- Bounds: each test has `--timeout` seconds (150; torch's harness then terminates its ranks); the runner kills "
    "the driver's whole process group 60 s after that, records a timeout and goes on with the next test in a new "
    "driver. The driver runs in its own session and that group is killed when it ends: no rank outlives the run.",
    "- Without GPUs most of the suite skips. On a machine with GPUs the same command runs the GPU tests with gloo; "
    "torch's harness skips every test when there are fewer GPUs than ranks (2).",
]


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def revision(root: Path) -> str:
    """The git revision of ``root``, noting uncommitted changes in src/."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True,
                               text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with uncommitted changes in src/" if dirty else "")


DIFFERENTIAL = ("Beyond torch's suite, `tests/differential/` draws configurations (model shapes x every DDP keyword x "
                "transports x world sizes x comm hooks x accumulation x join x checkpointing x lifetimes, and ZeRO) "
                "and runs fanfold's DDP and torch's side by side in the same ranks: see "
                "[differential.md](differential.md) for how, and for the counts of the last `make fuzz`.")


def write_page(page: Path, meta: dict, selected: list[str], outcomes: dict[str, dict[str, Outcome]]) -> None:
    tests = meta["tests"]
    t, f = outcomes["torch"], outcomes["fanfold"]
    count = {impl: Counter(o.status for name, o in outcomes[impl].items() if name in tests) for impl in outcomes}
    torch_pass = [n for n in tests if n in t and t[n].status == "pass"]
    both = [n for n in torch_pass if n in f and f[n].status == "pass"]
    differ = [n for n in tests if (t.get(n) and t[n].status) != (f.get(n) and f[n].status)]
    skips = Counter(_md(t[n].detail.strip().splitlines()[0] if t[n].detail.strip() else "no reason given")
                    for n in tests if n in t and t[n].status == "skip")
    root = Path(__file__).resolve().parents[1]
    out = [
        "# Conformance: torch's own DDP tests with fanfold's DistributedDataParallel",
        "",
        "Generated by `make conformance` (`conformance/run.py`); do not edit by hand: the reasons live in "
        "`conformance/reasons.py`.",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['started']}; fanfold revision {revision(root)}",
        f"- torch {torch.__version__}, Python {sys.version.split()[0]}, CPU, gloo, 2 ranks "
        f"(`BACKEND=gloo WORLD_SIZE=2`), rank processes started by `{meta.get('start_method', 'spawn')}`",
        "- wall time: " + ", ".join(f"{k} {v // 60} min {v % 60} s" for k, v in meta.get("seconds", {}).items()),
        "",
        "## What runs",
        "",
        "The suite is torch's `DistributedTest._DistTestBase` "
        "(`torch/testing/_internal/distributed/distributed_test.py`"
        " in the installed wheel), driven as torch's own `test/distributed/test_distributed_spawn.py` drives it. "
        "Selected: every `test_*` method whose name mentions DDP (`ddp`, `DistributedDataParallel`, any case) or "
        "that constructs `DistributedDataParallel(...)`, directly or through one of the class's `self._helper(...)` "
        f"methods (`conformance/selection.py`): {len(selected)} tests"
        + (f", of which this run took {len(tests)}" if len(tests) != len(selected) else "") + ". "
        "Each runs twice: with torch's DDP, and with `DistributedDataParallel` rebound to "
        "`fanfold.DistributedDataParallel` in `torch.nn.parallel`, `torch.nn.parallel.distributed` and the test "
        "module, in every rank process before the test starts (checked from inside a rank by "
        "`SelfCheck.test_ddp_names_in_rank` before each run). fanfold runs with `FANFOLD_TRANSPORT="
        f"{meta.get('transport', 'default')}` (default: `select_transport` picks shared memory on one host) and "
        "`FANFOLD_STALL_TIMEOUT=60`, the suite's own process-group timeout.",
        "",
        "## Counts",
        "",
        "| | pass | fail | timeout | skip |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {impl}'s DDP | " + " | ".join(str(count[impl][s]) for s in STATUSES) + " |"
          for impl in ("torch", "fanfold")),
        "",
        f"**Of the {len(torch_pass)} tests that pass with torch's DDP, {len(both)} pass with fanfold's.** "
        "A skipped test ran neither way (skips are decided by the test's own decorators: no GPU, NCCL only, ...); "
        "it counts as no evidence in either direction.",
        "",
        "Why tests skip (under torch's DDP): " + "; ".join(f"{c} × {r}" for r, c in skips.most_common()) + ".",
        "",
        "## Differences and their reasons",
        "",
    ]
    if differ:
        out += ["| test | torch | fanfold | reason |", "| --- | --- | --- | --- |"]
        out += [f"| `{n}` | {_cell(t.get(n))} | {_cell(f.get(n))} | {_reason(n, t.get(n), f.get(n))} |" for n in differ]
    else:
        out.append("None: every test has the same result with both.")
    out += ["", "## Every test", "", "| test | torch | fanfold |", "| --- | --- | --- |"]
    out += [f"| `{n}` | {_cell(t.get(n), why=True)} | {_cell(f.get(n))} |" for n in tests]
    out += ["", "## How to run", "", *HOW_TO_RUN]
    out += ["", *summary_lines(root / "build" / "conformance-backend")]
    out += ["", "## Differential fuzzing", "", DIFFERENTIAL]
    failing = [n for n in tests if n in f and f[n].status in ("fail", "timeout")]
    if failing:
        out += ["", "## fanfold's errors, as the ranks raised them", ""]
        out += [f"- `{n}`: " + " / ".join(f"`{_md(line[:300])}`" for line in error_lines(f[n].detail) or [f[n].status])
                for n in failing]
    page.write_text("\n".join(out) + "\n")
