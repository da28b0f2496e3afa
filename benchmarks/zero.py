"""Sharded Adam, side by side: fanfold DDP + torch.optim.Adam, fanfold DDP + fanfold.ZeroRedundancyOptimizer(Adam)
at stage 2 (``ddp.shard_gradients(opt)``), torch DDP + torch's ZeroRedundancyOptimizer(Adam); 2 ranks x 1 thread,
gloo, CPU.

    .venv/bin/python benchmarks/zero.py                 # 2 runs x 20 rounds x 3 steps, the 16.7M-parameter MLP
    .venv/bin/python benchmarks/zero.py --tiny          # a small MLP, 1 run x 2 rounds x 1 step: the set-up only

Model: benchmarks/ddp.py's MLP (1024 -> 4 x 2048 -> 1000, 16.7M parameters), batch 64 per rank, Adam lr 1e-4.

How it is timed: this VM's speed drifts by tens of per cent within minutes, so rows timed in separate launches (the
method before) were compared under different machines. Here a run is one launch holding all three rows (each its
own copy of the same initial model, the same batch): after ``--warmup`` steps each, the rows take turns in blocks
of ``--block`` steps (a step: forward, cross-entropy, zero_grad, backward, step), the order rotated each round
(``benchmarks/_blocks.py``); a block's time is the slowest rank's (stage 2's parameter all-gather ends inside
``step()``, so inside the clock). Reported per row: the median
block time over all runs; per ratio: the median over rounds of the ratio of two rows' blocks of the same round, and
how many rounds meet issue 14's targets (stage 2 <= 0.95x fanfold DDP + Adam, <= 0.80x torch's pair).

Peak resident memory (VmHWM) cannot be told apart with three rows in one process: a second, short pass launches
each row alone (``--mem-steps`` steps) and reads every rank's high-water mark, with the number of optimizer state
elements the rank holds. Results are checked: after timing, every row's parameters (a sample, rtol 1e-5) must equal
the first row's on rank 0, on every rank; the benchmark exits with an error naming the row and rank otherwise.
fanfold's DDP uses its default transport (shm here).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from _blocks import same_round_ratios, time_blocks, train_step  # benchmarks/_blocks.py
from torch import nn

import fanfold

ROWS = ("fanfold DDP + Adam", "fanfold DDP + fanfold ZeRO-2", "torch DDP + torch ZeRO")
STAGE2 = ROWS[1]
TARGETS = {ROWS[0]: 0.95, ROWS[2]: 0.80}  # stage 2's block over this row's block of the same round, at most


@dataclass
class RunResult:
    """One timing launch: per row, its blocks' seconds per step (slowest rank, in order); per rank and row, a sample
    of the final parameters."""

    blocks: dict[str, list[float]]
    samples: list[dict[str, torch.Tensor]]


@dataclass
class Footprint:
    """One row launched alone, per rank: peak resident MiB, optimizer state elements held; the model's size."""

    rss_mib: list[float]
    state: list[int]
    params: int


def build(tiny: bool) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    widths = [64, 128, 128, 128] if tiny else [1024, 2048, 2048, 2048, 2048]
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(widths[-1], 1000))
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return model, (torch.randn(64, widths[0], generator=g), torch.randint(0, 1000, (64,), generator=g))


def wrap(row: str, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None] | None]:
    """``row``'s DDP and optimizer around ``model``, and what ends one of its blocks (None: nothing)."""
    if row == ROWS[2]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-4), None
    ddp = fanfold.DistributedDataParallel(model)
    if row != STAGE2:
        return ddp, torch.optim.Adam(model.parameters(), lr=1e-4), None
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-4)
    ddp.shard_gradients(opt)
    # a read of the parameters at the block's end, inside the clock (the gathers end inside step())
    return ddp, opt, model.state_dict


def _sample(model: nn.Module) -> torch.Tensor:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat[:: max(1, flat.numel() // 10_000)].clone()


def one_run(tiny: bool, warmup: int, block: int, blocks: int) -> RunResult:
    """In each worker: the three rows, same weights and data, trained in rotating blocks."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    base, (x, y) = build(tiny)
    models = {row: copy.deepcopy(base) for row in ROWS}
    steps, finish = {}, {}
    for row in ROWS:
        ddp, opt, end = wrap(row, models[row])
        steps[row] = train_step(ddp, opt, x, y)
        if end is not None:
            finish[row] = end
    for row in ROWS:
        for _ in range(warmup):
            steps[row]()
        if row in finish:
            finish[row]()
    times = time_blocks(steps, block, blocks, finish)
    samples = {row: _sample(m) for row, m in models.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, samples)
    return RunResult(times, every)


def footprint(row: str, tiny: bool, steps: int) -> Footprint:
    """In each worker: ``row`` alone for ``steps`` steps; the high-water mark of this process's resident memory."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    model, (x, y) = build(tiny)
    ddp, opt, end = wrap(row, model)
    step = train_step(ddp, opt, x, y)
    for _ in range(steps):
        step()
    if end is not None:
        end()
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    inner = getattr(opt, "optim", opt)  # both ZeROs keep their local optimizer as .optim
    state = sum(t.numel() for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    both: list = [None] * dist.get_world_size()
    dist.all_gather_object(both, (rss, state))
    return Footprint([r for r, _ in both], [s for _, s in both], sum(p.numel() for p in model.parameters()))


def check(result: RunResult, run: int) -> None:
    """Same weights, data, optimizer and number of steps: every row must end at the first row's parameters."""
    ref = result.samples[0][ROWS[0]]
    for rank, samples in enumerate(result.samples):
        for row in ROWS:
            if not torch.allclose(samples[row], ref, rtol=1e-5, atol=1e-7):
                diff = (samples[row] - ref).abs().max().item()
                raise SystemExit(f"run {run + 1}, {row}, rank {rank}: parameters differ from {ROWS[0]}'s on rank 0 "
                                 f"(max abs diff {diff:.3g})")


def ratios(results: list[RunResult], base: str) -> list[float]:
    """Stage 2's block over ``base``'s of the same round, every round of every run."""
    return [q for r in results for q in same_round_ratios(r.blocks, STAGE2, base)]


def measure(args: argparse.Namespace) -> list[RunResult]:
    results = []
    for run in range(args.runs):
        result = fanfold.launch(one_run, args.tiny, args.warmup, args.block, args.blocks, nprocs=2, threads=1,
                                timeout=args.timeout)[0]
        check(result, run)
        results.append(result)
        print(f"run {run + 1}/{args.runs}: " + ", ".join(
            f"{row} {1e3 * statistics.median(result.blocks[row]):.1f}" for row in ROWS) + " ms/step; stage 2 vs "
            + ", ".join(f"{base} {statistics.median(ratios([result], base)):.3f}" for base in TARGETS),
            file=sys.stderr, flush=True)
    return results


def table(results: list[RunResult], mem: dict[str, Footprint]) -> str:
    lines = ["| row | step (ms, median of blocks) | stage 2 / this row (median of rounds) | rounds meeting the target "
             "| peak RSS per rank (MiB) | optimizer state elements per rank |", "|---|---|---|---|---|---|"]
    for row in ROWS:
        t = statistics.median([v for r in results for v in r.blocks[row]])
        ratio = within = ""
        if row in TARGETS:
            q = ratios(results, row)
            ratio = f"**{statistics.median(q):.3f}**"
            within = f"{sum(v <= TARGETS[row] for v in q)}/{len(q)} rounds <= {TARGETS[row]:.2f}"
        rss = " / ".join(f"{v:.0f}" for v in mem[row].rss_mib)
        state = " / ".join(str(v) for v in mem[row].state)
        lines.append(f"| {row} | {1e3 * t:.1f} | {ratio} | {within} | {rss} | {state} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2, help="timing launches")
    p.add_argument("--blocks", type=int, default=20, help="rounds per run: one block of every row each")
    p.add_argument("--block", type=int, default=3, help="steps per block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row first")
    p.add_argument("--mem-steps", type=int, default=3, help="steps of each row alone in the memory pass")
    p.add_argument("--tiny", action="store_true", help="a small MLP, 1 run x 2 rounds x 1 step: the set-up only")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch before giving up")
    args = p.parse_args()
    if args.tiny:
        args.runs, args.blocks, args.block, args.warmup, args.mem_steps = 1, 2, 1, 1, 2
    if min(args.runs, args.blocks, args.block, args.mem_steps) < 1 or args.warmup < 0:
        p.error("--runs, --blocks, --block and --mem-steps >= 1, --warmup >= 0")
    load = os.getloadavg()[0]
    results = measure(args)
    mem = {row: fanfold.launch(footprint, row, args.tiny, args.mem_steps, nprocs=2, threads=1,
                               timeout=args.timeout)[0] for row in ROWS}
    print(f"torch {torch.__version__}, MLP {mem[ROWS[0]].params / 1e6:.1f}M parameters, Adam, batch 64 per rank, "
          f"2 ranks x 1 thread, gloo; {args.runs} runs x {args.blocks} rounds x {args.block} steps per block "
          f"(+{args.warmup} warm-up per row), rows rotating; memory: each row alone, {args.mem_steps} steps; "
          f"results checked equal; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print(table(results, mem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
