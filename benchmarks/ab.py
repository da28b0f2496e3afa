"""Same-run alternating A/B of two versions of fanfold's source on issue 25's rows (this tree's harnesses for both).

    .venv/bin/python benchmarks/ab.py --old 45eaa1a --pairs 10            # new: this tree's src/
    .venv/bin/python benchmarks/ab.py --old 8570002 --rows ddp-mlp,cnn-64,cnn-256 --pairs 10
    .venv/bin/python benchmarks/ab.py --old HEAD --rows ddp-mlp --pairs 10  # the same code twice: the null result
    .venv/bin/python benchmarks/ab.py --old 45eaa1a --pairs 1 --quick     # checks the set-up only

Each measure is one fresh interpreter whose ``PYTHONPATH`` puts one version's ``src`` first (``git archive REV src``
for a revision), running one harness of benchmarks/ under ``fanfold.launch`` (2 ranks x 1 thread or one process with
2 CPU replicas). A pair runs every row on both versions back to back, the order flipped from one pair to the next,
so that drift of the machine falls on both alike. Reported per row: each version's median time and the median over
pairs of new/old time (below 1: the new code is faster).

That ratio moves by up to +-8% between launches of the SAME code (this VM's speed differs from one process to the
next: the bare model's step alone took 20 to 29 ms in eight launches), so each measure also times a reference that
does not depend on fanfold's version, inside the same processes, taking turns with fanfold's row in rotating blocks
(``benchmarks/_blocks.py``): torch's DDP over gloo for the DDP rows (its parameters must equal fanfold's at the end),
gloo's all_reduce on a gloo group for the all_reduce rows, torch's DDP + ZeroRedundancyOptimizer for zero2, the
bare module for the process engine's rows. The second ratio is then the median over pairs of new/old of
(fanfold's time / the reference's time of the same rounds), the launch's own speed divided out.

``--malloc fixed`` runs both versions with glibc's heap thresholds fixed (``MALLOC_MMAP_THRESHOLD_`` 32 MiB,
``MALLOC_TRIM_THRESHOLD_`` 4 GiB). By default glibc adapts them to what was freed and gives the top of the heap back to
the kernel when enough of it is free; whether a step's freed gradients sit at the top then depends on the order of
every allocation since the start, and when they do the next backward faults the pages in again (the MLP, one launch
each: 274-282 page faults a step for 8570002, 1,898-1,996 for e4e8391, with the same allocations a step). Fixed,
neither version hands memory back, and the ratio measures fanfold's code rather than that luck (docs/benchmarks.md,
"Round 7").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("ddp-mlp", "ddp-lm", "small-params", "allreduce-16k", "allreduce-64m", "zero2", "process-cnn-64",
        "process-cnn-256", "cnn-64", "cnn-256")
REFERENCE = {"ddp": "torch DDP", "cnn": "torch DDP", "small": "torch DDP", "allreduce": "gloo all_reduce",
             "zero2": "torch DDP + ZeRO", "process": "bare module"}


def paired_ddp(model: str, batch: int, warmup: int, block: int, rounds: int) -> dict[str, list[float]]:
    """In each worker: fanfold's DDP and torch's DDP (gloo) on copies of one model, fed the same batch, taking turns
    in blocks; each row's per-step seconds by round (the slowest rank's). Exits if their parameters differ."""
    import copy

    import ddp
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from _blocks import time_blocks
    from torch import nn

    import fanfold

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    if model in ("mlp", "lm"):
        base, (x, y) = ddp.build(model)
    else:
        import dp_engines  # imports the digits CNN from fanfold.training, which commits before 8570002 lack

        base, x, y = dp_engines.build(model, batch)
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    nets = {"fanfold": fanfold.DistributedDataParallel(copy.deepcopy(base)),
            "reference": nn.parallel.DistributedDataParallel(copy.deepcopy(base))}
    steps = {}
    for name, net in nets.items():
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)

        def step(net=net, opt=opt) -> None:
            out = net(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        steps[name] = step
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = time_blocks(steps, block, rounds)
    ours, theirs = nets["fanfold"].module, nets["reference"].module
    if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours.parameters(), theirs.parameters())):
        raise SystemExit(f"{model}: fanfold's DDP parameters differ from torch's after the same steps")
    nets.clear()  # torch's DDP goes before its group
    dist.destroy_process_group()
    return times


def paired_allreduce(numel: int, block: int, rounds: int) -> dict[str, list[float]]:
    """In each worker (``fanfold`` backend): its all_reduce and gloo's on a gloo group of the same ranks, the same
    tensor, taking turns in blocks of ``block`` calls; per-call seconds by round (the slowest rank's)."""
    import torch
    import torch.distributed as dist
    from _blocks import time_blocks

    torch.set_num_threads(1)
    dist.init_process_group("fanfold", timeout=timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    x = torch.randn(numel)
    calls = {"fanfold": lambda: dist.all_reduce(x), "reference": lambda: dist.all_reduce(x, group=gloo)}
    for call in calls.values():
        for _ in range(3):
            call()
    times = time_blocks(calls, block, rounds)
    dist.destroy_process_group()
    return times


def paired_process_engine(batch: int, warmup: int, block: int, rounds: int) -> dict[str, list[float]]:
    """In one process (2 threads): the process engine's DataParallel over 2 CPU replicas and the bare module, each its
    own copy of the digits CNN, taking turns in blocks; per-step seconds by round."""
    import copy

    import dp_engines
    import torch
    import torch.nn.functional as F

    import fanfold

    base, x, y = dp_engines.build("cnn", batch)
    nets = {"fanfold": fanfold.DataParallel(copy.deepcopy(base), ["cpu"] * 2, engine="process"),
            "reference": copy.deepcopy(base)}
    opts = {name: torch.optim.SGD(net.parameters(), lr=0.01) for name, net in nets.items()}

    def step(name: str) -> None:
        loss = F.cross_entropy(nets[name](x), y)
        opts[name].zero_grad(set_to_none=True)
        loss.backward()
        opts[name].step()

    for _ in range(warmup):
        for name in nets:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in nets}
    order = list(nets)
    for r in range(rounds):
        for name in order[r % 2:] + order[:r % 2]:
            start = time.perf_counter()
            for _ in range(block):
                step(name)
            times[name].append((time.perf_counter() - start) / block)
    nets["fanfold"].close()
    return times


def measure(row: str, quick: bool) -> dict[str, float]:
    """In the measuring interpreter: seconds per step or call of fanfold's ``row`` and of its reference, and the
    median over rounds of their ratio."""
    import ab

    import fanfold

    rounds = 2 if quick else 10
    if row in ("ddp-mlp", "ddp-lm", "cnn-64", "cnn-256"):
        model, batch = (row[4:], 0) if row.startswith("ddp") else ("cnn", int(row[4:]))
        block = 1 if quick or row == "ddp-lm" else 2 if row == "ddp-mlp" else 5
        per_rank = fanfold.launch(ab.paired_ddp, model, batch, 1 if quick else 3, block, rounds, nprocs=2, threads=1,
                                  timeout=600)
        times = per_rank[0]
    elif row == "small-params":
        import small_params

        per_rank = fanfold.launch(small_params.one_run, "gloo", 3, 5 if quick else 100, None, 0, nprocs=2,
                                  threads=1, timeout=600)
        if not all(r["close"] for r in per_rank):
            raise SystemExit("small-params: fanfold's DDP parameters differ from torch's")
        # its rows take turns step by step: the slowest rank's time of each step
        times = {key: [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))]
                 for key, name in (("fanfold", "fanfold DDP"), ("reference", "torch DDP"))}
    elif row.startswith("allreduce"):
        numel, block = (16 * 256, 200) if row.endswith("16k") else (64 * 2**18, 3)
        per_rank = fanfold.launch(ab.paired_allreduce, numel, 10 if quick else block, rounds, nprocs=2, threads=1,
                                  timeout=600)
        times = per_rank[0]
    elif row == "zero2":
        import zero

        per_rank = fanfold.launch(zero.one_run, quick, 1, 3, 2 if quick else 6, nprocs=2, threads=1, timeout=600)
        zero.check(per_rank[0], 0)
        times = {"fanfold": per_rank[0].blocks[zero.STAGE2], "reference": per_rank[0].blocks[zero.ROWS[2]]}
    elif row.startswith("process-cnn"):
        per_rank = fanfold.launch(ab.paired_process_engine, int(row.rsplit("-", 1)[1]), 1 if quick else 5,
                                  3 if quick else 5, rounds, nprocs=1, threads=2, timeout=600)
        times = per_rank[0]
    else:
        raise SystemExit(f"unknown row {row!r}; rows: {', '.join(ROWS)}")
    ratio = statistics.median(f / r for f, r in zip(times["fanfold"], times["reference"]))
    return {"fanfold": statistics.median(times["fanfold"]), "reference": statistics.median(times["reference"]),
            "ratio": ratio}


FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def run_one(src: Path, row: str, quick: bool, malloc: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{HERE}", OMP_NUM_THREADS="1",
               **(FIXED_MALLOC if malloc == "fixed" else {}))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", row] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{row} on {src}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", help="a git revision (required)")
    p.add_argument("--new", default=None, help="a git revision (default: this tree's src/)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny measures: checks the set-up only")
    p.add_argument("--malloc", choices=("default", "fixed"), default="default",
                   help="fixed: glibc's heap thresholds fixed for both versions (see the module's docstring)")
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
        got: dict = {(r, w): [] for r in rows for w in ("old", "new")}
        for k in range(args.pairs):
            order = ("old", "new") if k % 2 == 0 else ("new", "old")
            for row in rows:
                for who in order:
                    out = run_one(srcs[who], row, args.quick, args.malloc)
                    got[row, who].append(out)
                    print(f"pair {k + 1}/{args.pairs} {row:16s} {who}: {1e3 * out['fanfold']:9.3f} ms, reference "
                          f"{1e3 * out['reference']:9.3f} ms, ratio {out['ratio']:.3f}", file=sys.stderr, flush=True)
    print(f"old {args.old}, new {args.new or 'this tree'}; {args.pairs} alternating pairs; malloc {args.malloc}; "
          f"load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| row | median old (ms) | median new (ms) | median of new/old | reference (same processes) | "
          "median of new/old, each over its reference |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        old, new = got[row, "old"], got[row, "new"]
        raw = statistics.median(n["fanfold"] / o["fanfold"] for n, o in zip(new, old))
        ref = statistics.median(n["ratio"] / o["ratio"] for n, o in zip(new, old))
        print(f"| {row} | {1e3 * statistics.median(o['fanfold'] for o in old):.3f} | "
              f"{1e3 * statistics.median(n['fanfold'] for n in new):.3f} | {raw:.3f} | {REFERENCE[row.split('-')[0]]} "
              f"| {ref:.3f} |")
    print()
    for row in rows:
        print(f"{row}: fanfold / reference in the same processes, median over pairs: old "
              f"{statistics.median(o['ratio'] for o in got[row, 'old']):.3f}, new "
              f"{statistics.median(n['ratio'] for n in got[row, 'new']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
