"""docs/conformance-backend.md from ``collectives.py``'s runs (``build/conformance-backend/{gloo,fanfold}-N.json``),
and the summary of it that docs/conformance.md carries (``summary_lines``).

Layer: a tool beside the package, called by ``collectives.py --report`` and by ``report.py``; reads JSON only (no
torch), so the DDP page can summarise the backend runs without importing the suite.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["REASONS", "load", "counts", "write_page", "summary_lines", "COMMAND"]

STATUSES = ("pass", "fail", "skip")
COMMAND = "make conformance-backend"
PAGE = "conformance-backend.md"

# Every test whose result differs between the backends, and why (investigated, not guessed).
REASONS = {
    "test_monitored_barrier_gloo": (
        "torch's `dist.monitored_barrier` raises `ValueError: monitored_barrier is only implemented for GLOO "
        "backend` for any group whose backend is not named `gloo` (`get_backend(group) != Backend.GLOO` in "
        "`distributed_c10d.py`), before the group is asked. The fanfold group's own "
        "`group.monitored_barrier(timeout)` is gloo's and works (`tests/collectives/test_backend_timeouts.py`)."),
    "test_monitored_barrier_gloo_subgroup": "as `test_monitored_barrier_gloo`: torch checks the backend's name.",
    "test_monitored_barrier_failure_order": "as `test_monitored_barrier_gloo`: torch checks the backend's name.",
    "test_monitored_barrier_wait_all_ranks": "as `test_monitored_barrier_gloo`: torch checks the backend's name.",
    "test_all_gather_into_stack_tensor_cpu": (
        "gloo takes only the concatenated output layout of `all_gather_into_tensor` (`invalid tensor size`); torch "
        "documents the stacked one (NCCL's) too, and fanfold's shared memory takes both."),
    "test_reduce_scatter_tensor_stacked_cpu": (
        "gloo takes only the concatenated input layout of `reduce_scatter_tensor`; torch documents the stacked one "
        "too, and fanfold's shared memory takes both."),
}


def load(out: Path) -> dict[int, dict[str, dict]]:
    """The runs in ``out`` by world size, for the sizes run with both backends: {size: {backend: {test: result}}}."""
    runs = {}
    for path in sorted(out.glob("gloo-*.json")):
        size = int(path.stem.split("-")[1])
        other = out / f"fanfold-{size}.json"
        if other.exists():
            runs[size] = {b: json.loads((out / f"{b}-{size}.json").read_text()) for b in ("gloo", "fanfold")}
    return dict(sorted(runs.items()))


def counts(run: dict) -> dict[str, int]:
    return {s: sum(r["status"] == s for r in run.values()) for s in STATUSES}


def _both_pass(runs: dict) -> tuple[int, int]:
    gloo_pass = [t for t, r in runs["gloo"].items() if r["status"] == "pass"]
    return len(gloo_pass), sum(runs["fanfold"].get(t, {}).get("status") == "pass" for t in gloo_pass)


def _error(result: dict) -> str:
    lines = result.get("detail", "").strip().splitlines()
    errors = [x for x in lines if re.search(r"Error|Exception", x)] or lines  # not torch's repro hint
    return errors[-1].strip().replace("|", "/")[:160] if errors else ""


def summary_lines(out: Path) -> list[str]:
    """A short section for docs/conformance.md: what ran, the counts per size, the command, the page."""
    runs = load(out)
    lines = ["## torch's collective tests on the `fanfold` backend", "",
             "The `fanfold` torch.distributed backend runs torch's own collective tests of "
             "`DistributedTest._DistTestBase` (CPU) in place of gloo, every gloo group of the suite created as a "
             f"`fanfold` one: `{COMMAND}` (`conformance/collectives.py`), details in [{PAGE}]({PAGE})."]
    if not runs:
        return lines + ["", f"No results in `{out.name}/` when this page was written: run `{COMMAND}`."]
    lines += ["", "| ranks | gloo pass / fail / skip | fanfold pass / fail / skip | of gloo's passes, fanfold passes |",
              "| --- | --- | --- | --- |"]
    for size, r in runs.items():
        c = {b: counts(r[b]) for b in r}
        gloo_pass, both = _both_pass(r)
        cells = [" / ".join(str(c[b][s]) for s in STATUSES) for b in ("gloo", "fanfold")]
        lines.append(f"| {size} | " + " | ".join(cells) + f" | {both} of {gloo_pass} |")
    lost = sorted({t for r in runs.values() for t, g in r["gloo"].items()
                   if g["status"] == "pass" and r["fanfold"].get(t, {}).get("status") != "pass"})
    if lost:
        lines += ["", "Passing with gloo but not with fanfold: " + ", ".join(f"`{t}`" for t in lost)
                  + f" (the reasons: [{PAGE}]({PAGE}#differences-and-their-reasons))."]
    return lines


def write_page(page: Path, out: Path, meta: dict, selection: str) -> None:
    runs = load(out)
    if not runs:
        raise SystemExit(f"run both backends first (no gloo-N.json and fanfold-N.json pair in {out})")
    lines = ["# Conformance: torch's collective tests on the `fanfold` backend", "",
             f"Generated by `{COMMAND}` (`python conformance/collectives.py --all`); do not edit by hand: the reasons "
             "live in `conformance/backend_report.py`.", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "bound"]
    slowest = max((r["seconds"], t, f"{b}-{size}") for size, rs in runs.items() for b, run in rs.items()
                  for t, r in run.items())
    lines.append(f"- slowest test: `{slowest[1]}` on {slowest[2]}, {slowest[0]:g} s (no test ran into the bound)"
                 if slowest[0] < 0.9 * float(meta.get("bound", 300)) else
                 f"- slowest test: `{slowest[1]}` on {slowest[2]}, {slowest[0]:g} s: at the harness's bound")
    lines += ["", "## What runs", "", selection, "",
              "Each test runs twice at each size, in fresh rank processes: with gloo, and with every gloo group (the "
              "default one and `new_group`'s) created as a `fanfold` group, checked in every rank "
              "(`init_process_group` raises if the group is not fanfold's). Nothing else differs between the two "
              "runs: the suite takes its decisions (skips, expectations) from `BACKEND=gloo` both times.", "",
              "## Counts", "", "| ranks | backend | pass | fail | skip |", "| --- | --- | --- | --- | --- |"]
    for size, r in runs.items():
        lines += [f"| {size} | {b} | " + " | ".join(str(counts(r[b])[s]) for s in STATUSES) + " |" for b in r]
    lines.append("")
    for size, r in runs.items():
        gloo_pass, both = _both_pass(r)
        lines.append(f"- {size} ranks: **of the {gloo_pass} tests that pass with gloo, {both} pass with fanfold.**")
    lines += ["", "## Differences and their reasons", ""]
    differ = sorted({t for r in runs.values() for t in r["gloo"] if r["gloo"][t]["status"] !=
                     r["fanfold"].get(t, {}).get("status")})
    if differ:
        lines += ["| test | " + " | ".join(f"{s} ranks: gloo / fanfold" for s in runs) + " | reason |",
                  "| --- | " + " | ".join("---" for _ in runs) + " | --- |"]
        for t in differ:
            cells = [f"{r['gloo'].get(t, {}).get('status', '-')} / {r['fanfold'].get(t, {}).get('status', '-')}"
                     for r in runs.values()]
            failing = [r["fanfold"][t] for r in runs.values() if r["fanfold"].get(t, {}).get("status") == "fail"]
            why = REASONS.get(t) or ("not investigated: " + _error(failing[0]) if failing else "not investigated")
            lines.append(f"| `{t}` | " + " | ".join(cells) + f" | {why} |")
    else:
        lines.append("None: every test has the same result with both backends.")
    lines += ["", "## Every test", "", "| test | " + " | ".join(f"{s} ranks: gloo / fanfold" for s in runs)
              + " | why it skips or fails (gloo's run) |", "| --- | " + " | ".join("---" for _ in runs) + " | --- |"]
    for t in sorted({t for r in runs.values() for t in r["gloo"]}):
        cells = [f"{r['gloo'].get(t, {}).get('status', '-')} / {r['fanfold'].get(t, {}).get('status', '-')}"
                 for r in runs.values()]
        g = next(r["gloo"][t] for r in runs.values() if t in r["gloo"])
        note = g["detail"].strip().splitlines()[0][:100] if g["status"] == "skip" and g["detail"].strip() else (
            _error(g) if g["status"] == "fail" else "")
        lines.append(f"| `{t}` | " + " | ".join(cells) + f" | {note.replace('|', '/')} |")
    page.write_text("\n".join(lines) + "\n")
