"""Same-run alternating A/B of two versions of fanfold's source on issue 25's rows (this tree's harnesses for both).

    .venv/bin/python benchmarks/ab.py --old 45eaa1a --pairs 10            # new: this tree's src/
    .venv/bin/python benchmarks/ab.py --old 8570002 --rows ddp-mlp,cnn-64,cnn-256 --pairs 10
    .venv/bin/python benchmarks/ab.py --old 45eaa1a --pairs 1 --quick     # checks the set-up only

Each measure is one fresh interpreter whose ``PYTHONPATH`` puts one version's ``src`` first (``git archive REV src``
for a revision), running one harness function of benchmarks/ under ``fanfold.launch`` (2 ranks x 1 thread or one
process with 2 CPU replicas). A pair runs every row on both versions back to back, the order flipped from one pair
to the next, so that drift of the machine falls on both alike. Reported per row: each version's median and the
median over pairs of new/old time (below 1: the new code is faster). Rows ``cnn-64`` and ``cnn-256`` also time
torch's DDP in the same interpreter as fanfold's (their ratio fanfold/torch is printed too).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("ddp-mlp", "ddp-lm", "small-params", "allreduce-16k", "allreduce-64m", "zero2", "process-cnn-64",
        "process-cnn-256", "cnn-64", "cnn-256", "thread-cnn-64", "thread-cnn-256")


def measure(row: str, quick: bool) -> dict[str, float]:
    """In the measuring interpreter: seconds for ``row`` (``torch`` too, for the rows that time torch's DDP)."""
    import fanfold

    steps = 3 if quick else 20
    if row in ("ddp-mlp", "ddp-lm"):
        import ddp

        per_rank = fanfold.launch(ddp.one_run, "fanfold DDP", row[4:], 2, steps, None, None, nprocs=2, threads=1,
                                  timeout=600)
        return {"fanfold": max(t for t, *_ in per_rank)}
    if row == "small-params":
        import small_params

        per_rank = fanfold.launch(small_params.one_run, "gloo", 3, 5 if quick else 100, None, 0, nprocs=2,
                                  threads=1, timeout=600)
        if not all(r["close"] for r in per_rank):
            raise SystemExit("small-params: fanfold's DDP parameters differ from torch's")
        return {"fanfold": max(statistics.median(r["times"]["fanfold DDP"]) for r in per_rank)}
    if row.startswith("allreduce"):
        import backend

        latency, bandwidth = ([16], []) if row.endswith("16k") else ([], [64])
        per_rank = fanfold.launch(backend.collectives, "fanfold", latency, bandwidth, 20 if quick else 200,
                                  nprocs=2, threads=1, timeout=600)
        out = per_rank[0]
        if latency:
            return {"fanfold": out["all_reduce 16 KB p50 (us)"] * 1e-6}
        return {"fanfold": 64 * 2**20 / 1e9 / out["all_reduce 64 MB (GB/s)"]}
    if row == "zero2":
        import zero

        per_rank = fanfold.launch(zero.one_run, quick, 1, 3, 2 if quick else 6, nprocs=2, threads=1, timeout=600)
        zero.check(per_rank[0], 0)
        return {"fanfold": statistics.median(per_rank[0].blocks[zero.STAGE2])}
    if row.startswith(("process-cnn", "thread-cnn", "cnn")):
        import dp_engines

        batch = int(row.rsplit("-", 1)[1])
        warmup, steps = (1, 3) if quick else (5, 30)
        if row.startswith(("process", "thread")):
            name = "DataParallel " + ("process, 2 replicas" if row.startswith("process") else "thread, 2 CPU replicas")
            per_rank = fanfold.launch(dp_engines.one_row, name, "cnn", batch, warmup, steps, nprocs=1, threads=2,
                                      timeout=600)
            return {"fanfold": statistics.median(per_rank[0][0])}
        out = {}
        for who, name in (("fanfold", "fanfold DDP 2x1"), ("torch", "torch DDP 2x1")):
            per_rank = fanfold.launch(dp_engines.one_row, name, "cnn", batch, warmup, steps, nprocs=2, threads=1,
                                      timeout=600)
            out[who] = max(statistics.median(t) for t, _ in per_rank)
        return out
    raise SystemExit(f"unknown row {row!r}; rows: {', '.join(ROWS)}")


def run_one(src: Path, row: str, quick: bool) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{HERE}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", row] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{row} on {src}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", help="a git revision (required)")
    p.add_argument("--new", default=None, help="a git revision (default: this tree's src/)")
    p.add_argument("--rows", default=",".join(ROWS[:8]), help=f"comma-separated, of: {', '.join(ROWS)}")
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny measures: checks the set-up only")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.quick)))
        return 0
    rows = [r for r in args.rows.split(",") if r]
    if args.old is None or any(r not in ROWS for r in rows) or args.pairs < 1:
        p.error(f"--old is required; --rows takes {', '.join(ROWS)}; --pairs at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {}
        for who, rev in (("old", args.old), ("new", args.new)):
            if rev is None:
                srcs[who] = HERE.parent / "src"
                continue
            dest = Path(tmp) / who
            dest.mkdir()
            archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", rev, "src"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
            srcs[who] = dest / "src"
        times: dict = {(r, w): [] for r in rows for w in ("old", "new")}
        torch_times: dict = {(r, w): [] for r in rows for w in ("old", "new")}
        for k in range(args.pairs):
            order = ("old", "new") if k % 2 == 0 else ("new", "old")
            for row in rows:
                for who in order:
                    out = run_one(srcs[who], row, args.quick)
                    times[row, who].append(out["fanfold"])
                    if "torch" in out:
                        torch_times[row, who].append(out["torch"])
                    print(f"pair {k + 1}/{args.pairs} {row:16s} {who}: {1e3 * out['fanfold']:9.3f} ms",
                          file=sys.stderr, flush=True)
    print(f"old {args.old}, new {args.new or 'this tree'}; {args.pairs} alternating pairs; load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print("| row | median old (ms) | median new (ms) | median of new/old |")
    print("|---|---|---|---|")
    for row in rows:
        old, new = times[row, "old"], times[row, "new"]
        ratio = statistics.median(n / o for n, o in zip(new, old))
        print(f"| {row} | {1e3 * statistics.median(old):.3f} | {1e3 * statistics.median(new):.3f} | {ratio:.3f} |")
    for row in rows:
        for who in ("old", "new"):
            if torch_times[row, who]:
                mine = statistics.median(f / t for f, t in zip(times[row, who], torch_times[row, who]))
                print(f"{row} {who}: fanfold DDP / torch DDP in the same interpreter, median {mine:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
