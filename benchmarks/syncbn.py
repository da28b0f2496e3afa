"""SyncBatchNorm's cost: a training step of the main job's CNN under fanfold DDP, with SyncBatchNorm vs plain
BatchNorm (statistics per rank), 2 ranks x 1 thread (gloo, CPU).

    .venv/bin/python benchmarks/syncbn.py                 # 5 runs x 50 steps, per-rank batch 32 (the main job's)
    .venv/bin/python benchmarks/syncbn.py --quick         # 2 runs x 3 steps: a smoke test of the set-up
    .venv/bin/python benchmarks/syncbn.py --batch 128 --transport torch

The model is ``fanfold train --sync-bn``'s: ``fanfold.training.job.make_model(batch_norm=True)`` (two 3x3 convolutions,
each followed by BatchNorm2d, two linear layers) on 1x8x8 digit-sized inputs, AdamW as the main job; the SyncBatchNorm
row converts the same model with ``SyncBatchNorm.convert_sync_batchnorm``. A run is one fresh launch per row of
warm-up steps then ``--steps`` timed steps (forward, backward, optimizer step); its time is the slowest rank's mean
step time; the table shows the median over ``--runs``, the rows interleaved within each run so that load from other
programs falls on both alike. Overhead = SyncBatchNorm's step / BatchNorm's step - 1 (the issue's target: <= 10%).
SyncBatchNorm adds one all-reduce of 2C+1 float64 per layer in forward and one of 2C in backward (torch.distributed,
gloo: latency, not bandwidth, at these sizes), on top of DDP's gradient all-reduce (``--transport``).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fanfold
from fanfold import SyncBatchNorm
from fanfold.training.job import make_model

ROWS = ("BatchNorm, fanfold DDP", "SyncBatchNorm, fanfold DDP")


def one_run(row: str, batch: int, warmup: int, steps: int, transport: str | None) -> float:
    """In each worker: mean seconds per timed step on this rank."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    model = make_model(batch_norm=True)
    if row.startswith("SyncBatchNorm"):
        model = SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = fanfold.DistributedDataParallel(model, **({"transport": transport} if transport else {}))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.rand(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def step() -> None:
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    dist.barrier()  # start the clock together; the collectives keep the ranks in step from here on
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for run in range(args.runs):
        for row in ROWS:
            per_rank = fanfold.launch(one_run, row, args.batch, args.warmup, args.steps, args.transport,
                                      nprocs=2, threads=1, timeout=args.timeout)
            times[row].append(max(per_rank))
            print(f"run {run + 1}/{args.runs}  {row:28s} {1e3 * times[row][-1]:8.2f} ms/step", file=sys.stderr,
                  flush=True)
    return times


def table(times: dict[str, list[float]], batch: int) -> str:
    base = statistics.median(times[ROWS[0]])
    lines = ["| row | ranks x threads | step (ms, median) | samples/s | overhead |", "|---|---|---|---|---|"]
    for row in ROWS:
        t = statistics.median(times[row])
        overhead = "" if row == ROWS[0] else f"**{100 * (t / base - 1):+.1f}%**"
        lines.append(f"| {row} | 2 x 1 | {1e3 * t:.2f} | {2 * batch / t:.0f} | {overhead} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32: the main job's)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=50, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--quick", action="store_true", help="2 runs x 3 steps, 1 warm-up: checks the set-up only")
    p.add_argument("--transport", default=None, help="DDP's: torch or shm (default: fanfold's own choice)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch before giving up")
    args = p.parse_args()
    if args.quick:
        args.runs, args.steps, args.warmup = 2, 3, 1
    if args.batch < 2 or args.runs < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--batch >= 2, --runs and --steps >= 1, --warmup >= 0")
    load = os.getloadavg()[0]
    times = measure(args)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, gloo; {args.runs} runs x "
          f"{args.steps} steps (+{args.warmup} warm-up), batch {args.batch} per rank, DDP transport="
          f"{args.transport or 'default (select_transport)'}; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after\n")
    print(table(times, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
