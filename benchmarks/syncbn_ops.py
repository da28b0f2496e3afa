"""SyncBatchNorm's per-step work counted, not timed: Python calls (cProfile) and torch operator events
(torch.profiler) per training step of the main job's CNN under fanfold DDP, SyncBatchNorm vs plain BatchNorm, on
rank 0 of 2 ranks x 1 thread -- the set-up of ``benchmarks/syncbn.py``.

    .venv/bin/python benchmarks/syncbn_ops.py             # 20 counted steps after 5 warm-up steps
    .venv/bin/python benchmarks/syncbn_ops.py --steps 5

Counts hold on a busy machine, where timings do not: the table shows what each row does per step, and the operators
whose counts differ between the rows. The shared-memory transport's waiting loop makes a few Python calls a
collective that vary with how long a peer takes; the rest is exact.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from _blocks import train_step  # benchmarks/_blocks.py
from torch.profiler import ProfilerActivity, profile

import fanfold
from fanfold import SyncBatchNorm
from fanfold.training.job import make_model


def one_run(sync: bool, steps: int) -> tuple[float, dict[str, float]]:
    """In each worker: Python calls per step and torch operator events per step (by name)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = make_model(batch_norm=True)
    if sync:
        model = SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = fanfold.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.rand(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    step = train_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), x, y)

    for _ in range(5):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    calls = pstats.Stats(prof).total_calls / steps
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            step()
    return calls, {e.key: e.count / steps for e in p.key_averages()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="counted steps per row")
    args = p.parse_args()
    rows = {}
    for sync in (False, True):
        rows[sync] = fanfold.launch(one_run, sync, args.steps, nprocs=2, threads=1, timeout=300.0)[0]
    (plain_calls, plain_ops), (sync_calls, sync_ops) = rows[False], rows[True]
    print("| per step | BatchNorm | SyncBatchNorm | difference |\n|---|---|---|---|")
    print(f"| Python calls | {plain_calls:.0f} | {sync_calls:.0f} | {sync_calls - plain_calls:+.0f} |")
    total_plain, total_sync = sum(plain_ops.values()), sum(sync_ops.values())
    print(f"| torch operator events | {total_plain:.0f} | {total_sync:.0f} | {total_sync - total_plain:+.0f} |")
    for name in sorted(set(plain_ops) | set(sync_ops)):
        a, b = plain_ops.get(name, 0.0), sync_ops.get(name, 0.0)
        if abs(b - a) >= 0.5:
            print(f"| {name} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
