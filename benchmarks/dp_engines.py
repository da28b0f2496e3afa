"""DataParallel's engines side by side on the CPU: training step (forward, loss, backward, SGD) of the digits CNN and a
2-layer LSTM, against the bare module and both DDPs (issue 17).

    .venv/bin/python benchmarks/dp_engines.py                 # batches 64 and 256, 30 timed steps per row
    .venv/bin/python benchmarks/dp_engines.py --quick         # tiny: checks the set-up and the results only

Rows, at the same global batch: the bare module with 1 and with 2 intra-op threads; fanfold.DataParallel with 2 CPU
replicas in threads (``engine="thread"``) and in worker processes (``engine="process"``); fanfold's and torch's DDP,
2 ranks x 1 thread (each rank takes its half of the batch). Every row runs in a fresh process (``fanfold.launch``),
so the parent computes nothing and rows cannot disturb each other's thread pools; the figure is the median step time
(the slowest rank's, for DDP) over the timed steps. Results are checked: every row starts from the same weights and
batch, and its parameters after the timed steps must equal the bare module's (dropout is off), else it stops.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fanfold
from fanfold.training.job import make_model

# row -> (processes, intra-op threads per process)
ROWS = {
    "bare, 1 thread": (1, 1),
    "bare, 2 threads": (1, 2),
    "DataParallel thread, 2 CPU replicas": (1, 2),
    "DataParallel process, 2 replicas": (1, 2),
    "fanfold DDP 2x1": (2, 1),
    "torch DDP 2x1": (2, 1),
}


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def build(name: str, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (same weights in every row) and one synthetic batch."""
    torch.manual_seed(0)
    if name == "cnn":
        model = make_model()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0  # so that every row must end with the same parameters
        x = torch.randn(batch, 1, 8, 8)
    else:
        model, x = LSTMClassifier(), torch.randn(batch, 16, 32)
    return model, x, torch.randint(0, 10, (batch,))


def one_row(row: str, name: str, batch: int, warmup: int, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """In a launched process: the timed steps' durations and the parameters after them."""
    model, x, y = build(name, batch)
    if "DDP" in row:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        net = (nn.parallel.DistributedDataParallel(model) if row.startswith("torch")
               else fanfold.DistributedDataParallel(model))
    elif row.startswith("DataParallel"):
        net = fanfold.DataParallel(model, ["cpu"] * 2, engine="process" if "process" in row else "thread")
    else:
        net = model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for i in range(warmup + steps):
        if "DDP" in row and i == warmup:
            dist.barrier()
        start = time.perf_counter()
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if isinstance(net, fanfold.DataParallel):
        net.close()
    del net  # torch's DDP goes before its group: destroying the group under it can hang (docs/ddp-compat.md)
    if dist.is_initialized():
        dist.destroy_process_group()
    return times[warmup:], [p.detach().clone() for p in model.parameters()]


def check(row: str, params: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    for k, (p, q) in enumerate(zip(params, reference, strict=True)):
        if not torch.allclose(p, q, rtol=1e-3, atol=1e-5):
            raise SystemExit(f"{row}: parameter {k} differs from the bare module's after the same steps "
                             f"(max difference {(p - q).abs().max().item():.3g})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,lstm")
    p.add_argument("--batches", default="64,256", help="global batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="batches 8 and 16, 3 steps: checks the set-up only")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per row before giving up")
    args = p.parse_args()
    if args.quick:
        args.batches, args.steps, args.warmup = "8,16", 3, 1
    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batches.split(",") if b]
    if any(m not in ("cnn", "lstm") for m in models) or any(b < 2 or b % 2 for b in batches) or args.steps < 1:
        p.error("--models takes cnn and lstm; --batches even numbers >= 2; --steps >= 1")
    load = os.getloadavg()[0]
    lines = ["| model | global batch | " + " | ".join(ROWS) + " |", "|---|---|" + "---|" * len(ROWS)]
    for name in models:
        for batch in batches:
            cells, reference = [], None
            for row, (procs, threads) in ROWS.items():
                per_rank = fanfold.launch(one_row, row, name, batch, args.warmup, args.steps, nprocs=procs,
                                          threads=threads, timeout=args.timeout)
                step = max(statistics.median(t) for t, _ in per_rank)
                reference = per_rank[0][1] if reference is None else reference
                check(row, per_rank[0][1], reference)
                cells.append(f"{1e3 * step:.1f} ms")
                print(f"{name} {batch:4d} {row:36s} {1e3 * step:8.1f} ms/step", file=sys.stderr, flush=True)
            lines.append(f"| {name} | {batch} | " + " | ".join(cells) + " |")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {args.steps} timed steps (+{args.warmup} warm-up), "
          f"median; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; parameters checked\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
