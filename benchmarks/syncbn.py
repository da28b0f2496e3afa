"""SyncBatchNorm's cost: a training step of the main job's CNN under fanfold DDP, with SyncBatchNorm vs plain
BatchNorm (statistics per rank), 2 ranks x 1 thread (gloo, CPU).

    .venv/bin/python benchmarks/syncbn.py                 # 3 runs x 20 blocks x 10 steps, batch 32 per rank
    .venv/bin/python benchmarks/syncbn.py --quick         # 1 run x 2 blocks x 2 steps: a smoke test of the set-up
    .venv/bin/python benchmarks/syncbn.py --batch 128 --transport torch

The model is ``fanfold train --sync-bn``'s: ``fanfold.training.job.make_model(batch_norm=True)`` (two 3x3 convolutions,
each followed by BatchNorm2d, two linear layers) on 1x8x8 digit-sized inputs, AdamW as the main job; the SyncBatchNorm
row converts a copy of the same model with ``SyncBatchNorm.convert_sync_batchnorm``.

How it is timed: the step is ~10 ms and this VM's speed drifts by tens of per cent from one second to the next, so
separate launches per row (the method before) compared two rows under different machines. Here each run is one
launch in which both models, each under its own fanfold DDP, train in alternating blocks of ``--block`` steps
(``--blocks`` blocks each, the order rotated each round: ``benchmarks/_blocks.py``); a block's time is the slowest
rank's. Reported: the median block time per row over all runs, and the overhead as the median over block pairs of
SyncBatchNorm's block / the BatchNorm block of the same round - 1: a same-moment ratio (the issue's target: <= 10%).
Both models' parameters are checked to have changed (they trained) and the SyncBatchNorm model's running statistics
to be equal on both ranks.

SyncBatchNorm adds one all-reduce of 2C+1 float64 per layer in forward and one of 2C in backward, on DDP's
transport (the shared-memory one here: ~30 us each), on top of DDP's gradient all-reduce (``--transport``).
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from _blocks import same_round_ratios, time_blocks, train_step  # benchmarks/_blocks.py

import fanfold
from fanfold import SyncBatchNorm
from fanfold.training.job import make_model

ROWS = ("BatchNorm, fanfold DDP", "SyncBatchNorm, fanfold DDP")


@dataclass
class RunResult:
    """One launch, as rank 0 reports it: per row, its blocks' seconds per step (the slowest rank's), in order."""

    blocks: dict[str, list[float]]


def one_run(batch: int, warmup: int, block: int, blocks: int, transport: str | None) -> RunResult:
    """In each worker: both models trained in alternating blocks; every block timed on the slowest rank."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    plain = make_model(batch_norm=True)
    synced = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))
    options = {"transport": transport} if transport else {}
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.rand(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)
    steps = {}
    for row, model in zip(ROWS, (plain, synced)):
        ddp = fanfold.DistributedDataParallel(model, **options)
        steps[row] = train_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), x, y)
    start = {row: [p.detach().clone() for p in m.parameters()] for row, m in zip(ROWS, (plain, synced))}
    for row in ROWS:
        for _ in range(warmup):
            steps[row]()
    times = time_blocks(steps, block, blocks)
    for row, m in zip(ROWS, (plain, synced)):
        if all(torch.equal(a, b) for a, b in zip(start[row], m.parameters())):
            raise RuntimeError(f"{row}: the parameters did not change: nothing was trained")
    stats = torch.cat([b for b in synced.buffers() if b.is_floating_point()])
    other = stats.clone()
    dist.broadcast(other, src=0)
    if not torch.equal(stats, other):
        raise RuntimeError("SyncBatchNorm: the running statistics differ between the ranks")
    return RunResult(times)


def measure(args: argparse.Namespace) -> list[RunResult]:
    results = []
    for run in range(args.runs):
        result = fanfold.launch(one_run, args.batch, args.warmup, args.block, args.blocks, args.transport,
                                nprocs=2, threads=1, timeout=args.timeout)[0]
        results.append(result)
        ratios = pair_ratios([result])
        print(f"run {run + 1}/{args.runs}: " + ", ".join(
            f"{row} {1e3 * statistics.median(result.blocks[row]):.2f} ms/step" for row in ROWS)
            + f"; overhead {100 * (statistics.median(ratios) - 1):+.1f}% (median of {len(ratios)} block pairs)",
            file=sys.stderr, flush=True)
    return results


def pair_ratios(results: list[RunResult]) -> list[float]:
    """SyncBatchNorm's block over the BatchNorm block run next to it, for every pair of every run."""
    return [q for r in results for q in same_round_ratios(r.blocks, ROWS[1], ROWS[0])]


def table(results: list[RunResult], batch: int) -> str:
    ratios = pair_ratios(results)
    lines = ["| row | ranks x threads | step (ms, median of blocks) | samples/s | overhead (median of block pairs) "
             "| block pairs within +10% |", "|---|---|---|---|---|---|"]
    for row in ROWS:
        t = statistics.median([v for r in results for v in r.blocks[row]])
        overhead = within = ""
        if row == ROWS[1]:
            overhead = f"**{100 * (statistics.median(ratios) - 1):+.1f}%**"
            within = f"{sum(q <= 1.10 for q in ratios)} of {len(ratios)}"
        lines.append(f"| {row} | 2 x 1 | {1e3 * t:.2f} | {2 * batch / t:.0f} | {overhead} | {within} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32: the main job's)")
    p.add_argument("--runs", type=int, default=3, help="launches")
    p.add_argument("--blocks", type=int, default=20, help="timed blocks per row and run")
    p.add_argument("--block", type=int, default=10, help="steps per block")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per row first")
    p.add_argument("--quick", action="store_true", help="1 run x 2 blocks x 2 steps, 1 warm-up: the set-up only")
    p.add_argument("--transport", default=None, help="DDP's: torch or shm (default: fanfold's own choice)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch before giving up")
    args = p.parse_args()
    if args.quick:
        args.runs, args.blocks, args.block, args.warmup = 1, 2, 2, 1
    if args.batch < 2 or min(args.runs, args.blocks, args.block) < 1 or args.warmup < 0:
        p.error("--batch >= 2, --runs, --blocks and --block >= 1, --warmup >= 0")
    load = os.getloadavg()[0]
    results = measure(args)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, gloo; {args.runs} runs x "
          f"{args.blocks} blocks x {args.block} steps per row (+{args.warmup} warm-up), batch {args.batch} per rank, "
          f"DDP transport={args.transport or 'default (select_transport)'}; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after\n")
    print(table(results, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
