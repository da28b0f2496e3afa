"""Sharded Adam, side by side: fanfold DDP + torch.optim.Adam, fanfold DDP + fanfold.ZeroRedundancyOptimizer(Adam)
at stage 2 (``ddp.shard_gradients(opt)``), torch DDP + torch's ZeroRedundancyOptimizer(Adam); 2 ranks x 1 thread,
gloo, CPU.

    .venv/bin/python benchmarks/zero.py                 # 3 runs x 20 steps, the 16.7M-parameter MLP
    .venv/bin/python benchmarks/zero.py --tiny          # 1 run x 2 steps of a small MLP: checks the set-up only

Model: benchmarks/ddp.py's MLP (1024 -> 4 x 2048 -> 1000, 16.7M parameters), batch 64 per rank, Adam lr 1e-4.
A run is one fresh launch per row (rows interleaved within a run) of warm-up steps then ``--steps`` timed steps
(zero_grad, forward, backward, step); its time is the slowest rank's mean step time; the table shows the median over
``--runs``. Peak RSS is each rank's high-water mark (VmHWM) at the end of its run; optimizer state is the number of
state elements the rank holds. Every row starts from the same weights and data, and the rows' final parameters are
checked equal (a sample of them, rtol 1e-5) before the table is printed. fanfold's ZeRO here is stage 2: the
optimizer state and the averaged gradients sharded (each bucket reduce-scattered, ``.grad`` freed), the optimizer
stepping 1/2 of the parameters, which are then all-gathered. fanfold's DDP uses its default transport (shm here).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fanfold

ROWS = ["fanfold DDP + Adam", "fanfold DDP + fanfold ZeRO-2", "torch DDP + torch ZeRO"]


def build(tiny: bool) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    widths = [64, 128, 128, 128] if tiny else [1024, 2048, 2048, 2048, 2048]
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(widths[-1], 1000))
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return model, (torch.randn(64, widths[0], generator=g), torch.randint(0, 1000, (64,), generator=g))


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _state_elements(opt: torch.optim.Optimizer) -> int:
    inner = getattr(opt, "optim", opt)  # both ZeROs keep their local optimizer as .optim
    return sum(t.numel() for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def one_run(row: str, tiny: bool, warmup: int, steps: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    model, (x, y) = build(tiny)
    if row == "torch DDP + torch ZeRO":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-4)
    else:
        ddp = fanfold.DistributedDataParallel(model)
        if row == "fanfold DDP + fanfold ZeRO-2":
            opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-4)
            ddp.shard_gradients(opt)  # stage 2
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - start) / steps
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sample = flat[:: max(1, flat.numel() // 10_000)].clone()
    return {"seconds": seconds, "rss": _peak_rss_mib(), "state": _state_elements(opt), "params": flat.numel(),
            "sample": sample}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a small MLP, 1 run x 2 steps: checks the set-up only")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args()
    if args.tiny:
        args.runs, args.steps, args.warmup = 1, 2, 1
    results: dict = {row: [] for row in ROWS}
    for run in range(args.runs):
        for row in ROWS:
            per_rank = fanfold.launch(one_run, row, args.tiny, args.warmup, args.steps, nprocs=2, threads=1,
                                      timeout=args.timeout)
            results[row].append(per_rank)
            print(f"run {run + 1}/{args.runs}  {row:28s} {1e3 * max(r['seconds'] for r in per_rank):8.1f} ms/step",
                  file=sys.stderr, flush=True)
    # Same weights, data and optimizer everywhere: the rows must end at the same parameters on every rank.
    ref = results[ROWS[0]][-1][0]["sample"]
    for row in ROWS:
        for rank, r in enumerate(results[row][-1]):
            if not torch.allclose(r["sample"], ref, rtol=1e-5, atol=1e-7):
                diff = (r["sample"] - ref).abs().max().item()
                raise SystemExit(f"{row}, rank {rank}: parameters differ from {ROWS[0]}'s (max abs diff {diff:.3g})")
    n = results[ROWS[0]][0][0]["params"]
    print(f"torch {torch.__version__}, MLP {n / 1e6:.1f}M parameters, Adam, 2 ranks x 1 thread, gloo; "
          f"{args.runs} runs x {args.steps} steps (+{args.warmup} warm-up); results checked equal\n")
    def median(row: str) -> float:
        return statistics.median(max(r["seconds"] for r in pr) for pr in results[row])

    base, torch_pair = median(ROWS[0]), median(ROWS[2])
    print("| row | step (ms, median) | vs fanfold DDP + Adam | vs torch's pair | peak RSS per rank (MiB) | optimizer "
          "state elements per rank |\n|---|---|---|---|---|---|")
    for row in ROWS:
        t = median(row)
        rss = " / ".join(f"{statistics.median(pr[k]['rss'] for pr in results[row]):.0f}" for k in range(2))
        state = " / ".join(str(r["state"]) for r in results[row][-1])
        print(f"| {row} | {1e3 * t:.1f} | {t / base:.3f} | {t / torch_pair:.3f} | {rss} | {state} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
