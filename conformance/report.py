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
from reasons import CUDA_ONLY, INTERNAL, PORT_NOTES, REASONS

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
    "- `python conformance/run.py --cuda-on-cpu` (the second step of `make conformance`) runs the CPU port into "
    "`build/conformance/cuda-on-cpu/` and rewrites this page with both runs; the tests of CUDA itself that it does "
    "not run, one reason each, are `CUDA_ONLY` in `conformance/reasons.py`.",
]


def _cuda_skip(outcome: Outcome | None) -> bool:
    """Whether the plain run skipped the test for want of CUDA devices (torch's decorators say "CUDA")."""
    return outcome is not None and outcome.status == "skip" and "CUDA" in outcome.detail


def _port_note(test: str, t: Outcome | None, f: Outcome | None) -> str:
    """Why a test is not run, or what torch's DDP raises on the port, or why fanfold's result differs."""
    if test in CUDA_ONLY:
        return "CUDA itself: " + CUDA_ONLY[test]
    if t is not None and t.status == "skip":
        return "torch's own skip: " + _md(t.detail.strip().splitlines()[0][:80])
    if (t and t.status) != (f and f.status):
        return _reason(test, t, f)
    if test in PORT_NOTES:
        return PORT_NOTES[test]
    if t is not None and t.status in ("fail", "timeout"):
        lines = error_lines(t.detail)
        return "torch's DDP on the CPU: " + (_md(lines[0][:200]) if lines else t.status)
    return ""


def port_lines(meta: dict, outcomes: dict[str, dict[str, Outcome]], plain_torch: dict[str, Outcome]) -> list[str]:
    """The CPU port's section: counts over the tests the plain run skips for want of CUDA, then test by test."""
    tests = meta["tests"]
    t, f = outcomes["torch"], outcomes["fanfold"]
    cuda = [n for n in tests if _cuda_skip(plain_torch.get(n))]
    cpu = [n for n in tests if plain_torch.get(n) and plain_torch[n].status != "skip"]
    count = {impl: Counter(outcomes[impl][n].status for n in cuda if n in outcomes[impl]) for impl in outcomes}
    ran = [n for n in cuda if n in t and t[n].status != "skip"]
    cuda_only = [n for n in cuda if n in CUDA_ONLY]
    other = len(cuda) - len(ran) - len(cuda_only)
    own = [n for n in tests if plain_torch.get(n) and plain_torch[n].status == "skip" and n not in cuda]
    torch_pass = [n for n in cuda if n in t and t[n].status == "pass"]
    both = [n for n in torch_pass if n in f and f[n].status == "pass"]
    differ = [n for n in tests if (t.get(n) and t[n].status) != (f.get(n) and f[n].status)]
    same_cpu = [n for n in cpu if n in t and n in f and t[n].status == plain_torch[n].status]
    root = Path(__file__).resolve().parents[1]
    out = [
        "## The CPU port: the CUDA tests on CPU ranks",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['started']}; fanfold revision {meta.get('revision') or revision(root)}",
        "- wall time: " + ", ".join(f"{k} {v // 60} min {v % 60} s" for k, v in meta.get("seconds", {}).items()),
        "",
        "The same tests, run with the suite's CUDA devices mapped to the CPU in every rank process before the test "
        "starts (`conformance/cuda_on_cpu.py`, nothing of torch's edited): the suite's code sees a node of 8 CUDA "
        "devices (its global `torch` in `distributed_test` and `common_distributed` has a `cuda` whose "
        "`is_available()` is True, `device_count()` 8, `set_device`/`synchronize`/`device(i)` no-ops; "
        "`TEST_CUDA` is True), so its skip decorators let the tests run; a torch function mode puts every tensor the "
        "test asks for on a CUDA device (`device=`, `.cuda()`, `.to(\"cuda:1\")`, an index) on the CPU, as "
        "`nn.Module.to` does; DDP, torch's or fanfold's, drops `device_ids` and `output_device` (torch's refuses them "
        "for a CPU module). torch itself is not told it has CUDA: where its DDP needs CUDA on its own (SyncBatchNorm, "
        "mixed precision's streams, the optimizer-in-backward hook's stream) the test fails with torch's DDP and "
        "counts as no evidence. A test whose subject is CUDA itself is not run (listed below with its reason).",
        "",
        f"Of the {len(cuda)} tests the run above skips for want of CUDA, **{len(ran)} run on the port** and "
        f"{len(cuda_only)} stay skipped as tests of CUDA itself" + (f" ({other} skip otherwise)" if other else "")
        + f"; the other {len(own)} skips of the run above are torch's own on Linux (known failures, flakiness) and "
        "skip here too.",
        "",
        f"| the {len(cuda)} CUDA tests | pass | fail | timeout | skip |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {impl}'s DDP | " + " | ".join(str(count[impl][s]) for s in STATUSES) + " |"
          for impl in ("torch", "fanfold")),
        "",
        f"**Of the {len(torch_pass)} that pass with torch's DDP, {len(both)} pass with fanfold's.** The "
        f"{len(cpu)} tests that run without CUDA run on the port too, as a check of the mapping: "
        f"{len(same_cpu)} of them have the result torch's DDP has in the run above.",
        "",
        "### Differences on the port and their reasons",
        "",
    ]
    if differ:
        out += ["| test | torch | fanfold | reason |", "| --- | --- | --- | --- |"]
        out += [f"| `{n}` | {_cell(t.get(n))} | {_cell(f.get(n))} | {_reason(n, t.get(n), f.get(n))} |"
                for n in differ]
    else:
        out.append("None: every test has the same result with both.")
    out += ["", "### Every test on the port", "", "| test | torch | fanfold | note |", "| --- | --- | --- | --- |"]
    out += [f"| `{n}` | {_cell(t.get(n))} | {_cell(f.get(n))} | {_port_note(n, t.get(n), f.get(n))} |"
            for n in tests]
    return out


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


def fuzz_summary(differential: Path) -> list[str]:
    """The last `make fuzz` run's headline and its table of outcomes, from the report `fuzz.py` wrote into
    ``differential`` (between its markers); nothing where there is none."""
    text = differential.read_text() if differential.exists() else ""
    if "<!-- fuzz-report -->" not in text:
        return []
    report = text.split("<!-- fuzz-report -->", 1)[1].split("<!-- /fuzz-report -->", 1)[0].strip().split("\n\n")
    table = next((b for b in report if b.startswith("| outcome")), None)
    return ["", "Its last run: " + report[0].strip(), *(["", table] if table else [])]


def write_page(page: Path, meta: dict, selected: list[str], outcomes: dict[str, dict[str, Outcome]],
               port: tuple[dict, dict[str, dict[str, Outcome]]] | None = None) -> None:
    """The page: the run on CPU as torch's suite decides; then, given ``port`` (the CPU port's metadata and
    outcomes), its section."""
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
        f"- date: {meta['started']}; fanfold revision {meta.get('revision') or revision(root)}",
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
    if port is not None:
        out += ["", *port_lines(*port, t)]
    out += ["", "## How to run", "", *HOW_TO_RUN]
    out += ["", *summary_lines(root / "build" / "conformance-backend")]
    out += ["", "## The differential fuzz (`make fuzz`)", "", DIFFERENTIAL]
    out += fuzz_summary(page.parent / "differential.md")
    failing = [n for n in tests if n in f and f[n].status in ("fail", "timeout")]
    if failing:
        out += ["", "## fanfold's errors, as the ranks raised them", ""]
        out += [f"- `{n}`: " + " / ".join(f"`{_md(line[:300])}`" for line in error_lines(f[n].detail) or [f[n].status])
                for n in failing]
    page.write_text("\n".join(out) + "\n")
