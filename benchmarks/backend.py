"""The ``fanfold`` torch.distributed backend against gloo, side by side (2 ranks x 1 thread, CPU).

    .venv/bin/python benchmarks/backend.py             # latency, bandwidth, torch DDP on the 16.7M MLP (minutes)
    .venv/bin/python benchmarks/backend.py --quick     # tiny sizes, few iterations: a smoke test of the set-up

Rows: all_reduce latency (fp32, 4-64 KB; median over ``--iters`` / 10 samples, each 20 calls back to back after
one untimed call, divided by 20), all_reduce /
reduce_scatter_tensor / all_gather_into_tensor bandwidth (fp32, 4-64 MB; bytes of the full tensor / median time),
and torch's own DistributedDataParallel on the 16.7M-parameter MLP of ``benchmarks/ddp.py`` (median step time over
``--steps`` after warm-up). Each backend runs in one fresh launch (``fanfold.launch``) per section; the time of a
call is the slowest rank's. On ``fanfold`` all four run in shared memory (docs/backend.md); the latency rows take
its caller-thread path (an all_reduce of at most 64 KiB while nothing is queued).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fanfold

BACKENDS = ("gloo", "fanfold")


def _timed(call, iters: int, repeat: int = 1) -> list[float]:
    """Seconds per call, each the slowest rank's (a MAX all-reduce of the times on a gloo side group). ``repeat``
    calls back to back per sample, divided: the ranks leave a barrier up to hundreds of microseconds apart (gloo's
    goes through TCP), which would otherwise be timed as the latency of a small collective."""
    times = []
    for _ in range(iters):
        dist.barrier()
        call()  # the ranks in step again: the first call absorbs the barrier's skew
        t0 = time.perf_counter()
        for _ in range(repeat):
            call()
        times.append((time.perf_counter() - t0) / repeat)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def collectives(backend: str, latency_kb: list[int], bandwidth_mb: list[int], iters: int) -> dict:
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    n = dist.get_world_size()
    out = {}
    for kb in latency_kb:
        x = torch.randn(kb * 256)
        _timed(lambda: dist.all_reduce(x), 3)
        per_call = _timed(lambda: dist.all_reduce(x), max(3, iters // 10), repeat=20)
        out[f"all_reduce {kb} KB p50 (us)"] = statistics.median(per_call) * 1e6
    for mb in bandwidth_mb:
        x, part = torch.randn(mb * 262144), torch.empty(mb * 262144 // n)
        calls = {"all_reduce": lambda: dist.all_reduce(x),
                 "reduce_scatter": lambda: dist.reduce_scatter_single(part, x),  # reduce_scatter_tensor's new name
                 "all_gather": lambda: dist.all_gather_single(x, part)}  # all_gather_into_tensor's
        for name, call in calls.items():
            _timed(call, 1)
            seconds = statistics.median(_timed(call, max(3, iters // 10)))
            out[f"{name} {mb} MB (GB/s)"] = mb * 2**20 / seconds / 1e9
    dist.destroy_process_group()
    return out


def ddp(backend: str, warmup: int, steps: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from ddp import build  # benchmarks/ddp.py's MLP

    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    model, (x, y) = build("mlp")
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
    for _ in range(warmup):
        step()
    seconds = statistics.median(_timed(step, steps))
    wrapped = step = None  # torch's DDP goes before its group: destroying the group under it can hang
    dist.destroy_process_group()
    return {"torch DDP, MLP 16.7M, step (ms)": seconds * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few iterations")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    latency, bandwidth = ([4], [1]) if args.quick else ([4, 16, 64], [4, 16, 64])
    iters, warmup, steps = (5, 1, 2) if args.quick else (args.iters, 3, args.steps)
    results = {b: {} for b in BACKENDS}
    for b in BACKENDS:
        results[b].update(fanfold.launch(collectives, b, latency, bandwidth, iters, nprocs=2, timeout=1800)[0])
        results[b].update(fanfold.launch(ddp, b, warmup, steps, nprocs=2, timeout=1800)[0])
    print("| measure | gloo | fanfold | fanfold / gloo |\n|---|---|---|---|")
    for key in results["gloo"]:
        g, f = results["gloo"][key], results["fanfold"][key]
        print(f"| {key} | {g:.4g} | {f:.4g} | {f / g:.2f} |")
    print(f"\n2 ranks x 1 thread, torch {torch.__version__}; each figure a median (latency: p50).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
