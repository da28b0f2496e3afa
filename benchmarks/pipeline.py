"""Pipeline training step vs the sequential model on one thread: throughput and measured bubble (CPU).

    .venv/bin/python benchmarks/pipeline.py                 # 3 runs x 5 steps, MLP 8 x 2048^2, batch 512 (minutes)
    .venv/bin/python benchmarks/pipeline.py --quick         # tiny sizes, 1 run: checks the set-up and the results
    .venv/bin/python benchmarks/pipeline.py --width 1024 --layers 12 --batch 512 --schedule gpipe --chunks 1,4,16

The model: ``--layers`` Linear(width, width) + ReLU pairs, cut into 2 stages of equal halves (same cost per stage),
MSE loss against a random target. A step is forward + backward (no optimizer: it would add the same serial time to
every row). Rows: the sequential model in one process on 1 intra-op thread (``loss.backward()``); ``Pipeline`` with
2 stages on 2 worker threads of one process, 1 intra-op thread each (``train_step``); ``DistributedPipeline`` with
one stage per process, 2 processes x 1 thread (gloo); each pipeline row at every ``--chunks``. Speed-up = sequential
step time / the row's: 2 stages on 2 cores can give at most 2x, and M micro-batches at most 2M / (M + 1)
(1.78x at M = 8), the ideal bubble being (S - 1) / (M + S - 1). Measured bubble = 1 - (time a stage spends in its
forward and backward steps, from the arrival of their inputs to their end) / (the step's wall time), averaged over
the stages and the timed steps: it counts the pipeline's own overheads (splitting, hand-offs) as bubble too.

Every row is a fresh launch (``fanfold.launch``; the parent computes nothing), rows interleaved within each run so
that load from other programs falls on all of them alike; the tables show medians over ``--runs``. Before timing,
each pipeline row's first step is compared with the sequential model's (loss and a sample of every gradient); a
mismatch fails the benchmark.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import fanfold
import fanfold.distributed


def build(width: int, pairs: int, batch: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(pairs) for m in (nn.Linear(width, width), nn.ReLU())])
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def digest(module: nn.Module) -> dict[str, torch.Tensor]:
    """A sample of every gradient (every 997th element), enough to tell equal from different."""
    return {n: p.grad.reshape(-1)[::997].double().clone() for n, p in module.named_parameters()}


def busy_fraction(timeline: list, wall: float) -> float:
    """The mean over the stages in ``timeline`` of the share of ``wall`` (the step's time) they spent working."""
    stages = sorted({t.stage for t in timeline})
    if not stages:
        return float("nan")
    return statistics.mean(sum(t.end - t.start for t in timeline if t.stage == s) / wall for s in stages)


def one_run(row: str, chunks: int, args: argparse.Namespace) -> dict:
    """In each worker: seconds per timed step, the measured busy fraction, and the first step's loss and gradients."""
    model, x, y = build(args.width, 2 * args.layers, args.batch)
    half = [2 * args.layers, 2 * args.layers]  # modules per stage: --layers Linear + ReLU pairs each
    if row == "sequential":
        def step() -> tuple[float, list]:
            model.zero_grad(set_to_none=True)
            loss = mse(model(x), y)
            loss.backward()
            return loss.item(), []
        grads_of = model
    elif row == "pipeline":
        pipe = fanfold.Pipeline(model, half, ["cpu", "cpu"], chunks=chunks, threads_per_stage=1)

        def step() -> tuple[float, list]:
            pipe.zero_grad(set_to_none=True)
            loss = pipe.train_step(x, y, mse, schedule=args.schedule)
            return loss.item(), pipe.last_timeline
        grads_of = pipe
    else:
        fanfold.distributed.init_process_group(timeout=600)
        pipe = fanfold.DistributedPipeline(model, half, chunks=chunks)

        def step() -> tuple[float, list]:
            pipe.zero_grad(set_to_none=True)
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, mse,
                                   schedule=args.schedule)
            return loss.item(), pipe.last_timeline
        grads_of = pipe
    first_loss, _ = step()
    first = digest(grads_of)
    for _ in range(args.warmup):
        step()
    if row == "processes":
        dist.barrier()  # start the clock together
    times, busy = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        _, timeline = step()
        times.append(time.perf_counter() - start)
        busy.append(busy_fraction(timeline, times[-1]))
    return {"step": statistics.mean(times), "busy": statistics.mean(busy), "loss": first_loss, "grads": first}


def check(name: str, got: dict, ref: dict) -> list[str]:
    problems = []
    if abs(got["loss"] - ref["loss"]) > 1e-4 * max(1.0, abs(ref["loss"])):
        problems.append(f"{name}: loss {got['loss']:.6g} but the sequential model's is {ref['loss']:.6g}")
    for key, value in got["grads"].items():
        if not torch.allclose(value, ref["grads"][key], rtol=1e-3, atol=1e-6):
            gap = (value - ref["grads"][key]).abs().max().item()
            problems.append(f"{name}: gradient of {key} differs from the sequential model's by up to {gap:.3g}")
    return problems


def measure(args: argparse.Namespace) -> tuple[dict, list[str]]:
    rows = [("sequential", 1)] + [(kind, c) for c in args.chunks for kind in ("pipeline", "processes")]
    results: dict = {r: [] for r in rows}
    problems: list[str] = []
    for run in range(args.runs):
        for kind, chunks in rows:
            ranks = 2 if kind == "processes" else 1
            per_rank = fanfold.launch(one_run, kind, chunks, args, nprocs=ranks, threads=1, timeout=args.timeout)
            merged = {"step": max(r["step"] for r in per_rank), "busy": statistics.mean(r["busy"] for r in per_rank),
                      "loss": per_rank[-1]["loss"], "grads": {k: v for r in per_rank for k, v in r["grads"].items()}}
            results[kind, chunks].append(merged)
            if run == 0 and kind != "sequential":
                problems += check(f"{kind} chunks={chunks}", merged, results["sequential", 1][0])
            print(f"run {run + 1}/{args.runs}  {kind:10s} chunks={chunks:<3d} {1e3 * merged['step']:9.1f} ms/step",
                  file=sys.stderr, flush=True)
    return results, problems


def table(args: argparse.Namespace, results: dict) -> str:
    base = statistics.median(r["step"] for r in results["sequential", 1])
    lines = ["| row | chunks | step (ms, median) | samples/s | speed-up vs sequential 1 thread | measured bubble | "
             "ideal bubble |", "|---|---|---|---|---|---|---|"]
    lines.append(f"| sequential, 1 process x 1 thread | - | {1e3 * base:.1f} | {args.batch / base:.1f} | 1.00 | - "
                 "| - |")
    for kind, label in (("pipeline", "Pipeline, 2 stages on 2 threads"),
                        ("processes", "DistributedPipeline, 2 processes x 1 thread")):
        for c in args.chunks:
            step = statistics.median(r["step"] for r in results[kind, c])
            bubble = 1 - statistics.median(r["busy"] for r in results[kind, c])
            micro = len(range(0, args.batch, -(-args.batch // c)))  # torch.chunk: fewer for a small batch
            lines.append(f"| {label} | {c} | {1e3 * step:.1f} | {args.batch / step:.1f} | {base / step:.2f} | "
                         f"{bubble:.3f} | {1 / (micro + 1):.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4, help="Linear + ReLU pairs per stage (2 stages)")
    p.add_argument("--batch", type=int, default=512, help="at chunks=8, micro-batches of 64 rows")
    p.add_argument("--chunks", default="1,2,4,8", help="comma-separated micro-batch counts")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="width 64, 2 pairs per stage, batch 32, 1 run x 2 steps")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch before giving up")
    args = p.parse_args()
    if args.quick:
        args.width, args.layers, args.batch, args.runs, args.steps, args.warmup = 64, 2, 32, 1, 2, 1
    args.chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    if min(args.chunks) < 1 or min(args.width, args.layers, args.batch, args.runs, args.steps) < 1:
        p.error("--chunks, --width, --layers, --batch, --runs and --steps take values >= 1")
    load = os.getloadavg()[0]
    results, problems = measure(args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {cores} cores; MLP "
          f"{2 * args.layers} x Linear({args.width}, {args.width}), batch {args.batch}, schedule {args.schedule}; "
          f"{args.runs} runs x {args.steps} steps (+{args.warmup} warm-up); load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after\n")
    print(table(args, results))
    if problems:
        print("\nRESULTS DIFFER:\n" + "\n".join(problems))
        return 1
    print("\nresults equal the sequential model's (loss and gradients, first step of every pipeline row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
