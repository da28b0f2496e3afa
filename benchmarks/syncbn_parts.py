"""SyncBatchNorm's overhead taken apart: its arithmetic alone, its collectives' meetings alone, and both, against
plain BatchNorm -- a training step of the main job's CNN under fanfold DDP, 2 ranks x 1 thread (gloo, CPU).

    .venv/bin/python benchmarks/syncbn_parts.py               # 3 runs x 20 blocks x 10 steps per row
    .venv/bin/python benchmarks/syncbn_parts.py --quick       # 1 run x 2 blocks x 2 steps: the set-up only

Rows, all in the same two processes, trained in alternating blocks (as ``benchmarks/syncbn.py``; each a fanfold DDP
of ``make_model(batch_norm=True)`` from the same weights):

- BatchNorm: plain ``nn.BatchNorm2d`` (statistics per rank);
- SyncBatchNorm: ``fanfold.SyncBatchNorm``, as users run it;
- arithmetic only: SyncBatchNorm whose sums over the ranks are replaced by the rank's own vector (every small
  operation, the autograd Function and the kernels, no communication; its results are wrong by design: timing only);
- meetings only: plain BatchNorm plus, per layer, an empty all-reduce of 2C+1 float64 before its forward and one
  of 2C after its backward on DDP's transport (``all_reduce_now``), as SyncBatchNorm issues them (each rank waits
  for the other).

Overhead of a row: the median over blocks of its block time / the BatchNorm block of the same round - 1.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _blocks import same_round_ratios, time_blocks, train_step  # benchmarks/_blocks.py
from torch import nn

import fanfold
from fanfold import SyncBatchNorm
from fanfold.training.job import make_model

ROWS = ("BatchNorm", "SyncBatchNorm", "arithmetic only", "meetings only")


class _LocalSum(SyncBatchNorm):
    """SyncBatchNorm's training path with a no-op in place of each sum over the ranks."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        self.num_batches_tracked.add_(1)
        return self._synchronised(input, self.momentum, None, lambda vec, phase: vec)


class _Meet(torch.autograd.Function):
    """Identity whose forward and backward each wait for an empty all-reduce of ``numel`` float64 numbers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: _MeetingBatchNorm) -> torch.Tensor:
        layer.meet(2 * layer.num_features + 1)
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.layer.meet(2 * ctx.layer.num_features)
        return grad, None


class _MeetingBatchNorm(nn.BatchNorm2d):
    transport: Any = None  # DDP's, set after wrapping

    def meet(self, numel: int) -> None:
        self.transport.all_reduce_now(torch.zeros(numel, dtype=torch.float64))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(_Meet.apply(input, self))


def _model(row: str) -> nn.Module:
    torch.manual_seed(0)
    model = make_model(batch_norm=True)
    if row == "SyncBatchNorm":
        return SyncBatchNorm.convert_sync_batchnorm(model)
    if row == "arithmetic only":
        return _LocalSum.convert_sync_batchnorm(model)
    if row == "meetings only":
        for i, m in enumerate(model):
            if isinstance(m, nn.BatchNorm2d):
                model[i] = _MeetingBatchNorm(m.num_features)
    return model


def one_run(batch: int, block: int, blocks: int) -> dict[str, list[float]]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.rand(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)
    steps = {}
    for row in ROWS:
        model = _model(row)
        ddp = fanfold.DistributedDataParallel(model)
        for m in model.modules():
            if isinstance(m, _MeetingBatchNorm):
                m.transport = ddp.transport
        steps[row] = train_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), x, y)
        for _ in range(5):
            steps[row]()
    return time_blocks(steps, block, blocks)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32: the main job's)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--block", type=int, default=10, help="steps per block")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    if args.quick:
        args.runs, args.blocks, args.block = 1, 2, 2
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for run in range(args.runs):
        result = fanfold.launch(one_run, args.batch, args.block, args.blocks, nprocs=2, threads=1,
                                timeout=args.timeout)[0]
        for row in ROWS:
            times[row] += result[row]
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
    print(f"torch {torch.__version__}; {args.runs} runs x {args.blocks} blocks x {args.block} steps per row, batch "
          f"{args.batch} per rank, 2 ranks x 1 thread, fanfold DDP (default transport)\n")
    print("| row | step (ms, median of blocks) | vs BatchNorm (median of same-round ratios) |\n|---|---|---|")
    for row in ROWS:
        ratio = statistics.median(same_round_ratios(times, row, ROWS[0]))
        versus = "" if row == ROWS[0] else f"{100 * (ratio - 1):+.1f}%"
        print(f"| {row} | {1e3 * statistics.median(times[row]):.2f} | {versus} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
