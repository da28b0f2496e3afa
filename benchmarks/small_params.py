"""DDP on a model of many small parameters: fanfold's DDP against torch's, on gloo and on the ``fanfold`` backend.

    .venv/bin/python benchmarks/small_params.py              # 5 warm-up + 200 timed steps per row (a minute or two)
    .venv/bin/python benchmarks/small_params.py --quick      # 1 warm-up + 5 steps: checks the set-up and the results
    .venv/bin/python benchmarks/small_params.py --profile 30 # also cProfile 30 fanfold DDP steps on rank 0

The model: 200 x (Linear(16, 16), LayerNorm(16)), 800 parameter tensors, 60,800 parameters (238 KiB of fp32
gradients: one bucket), batch 32 per rank, MSE loss, SGD. Here the per-parameter cost of a reducer (hooks,
bookkeeping, copies) is what a DDP step costs beyond the bare model's, not the bytes on the wire.

One launch (``fanfold.launch``, 2 ranks x 1 thread) per backend, ``init_process_group("gloo")`` then
``init_process_group("fanfold")``. In each, the rows run interleaved, one step of each in turn, so that load from
other programs falls on all of them alike: the bare model (no DDP, each rank alone: the compute floor), torch's
DistributedDataParallel and fanfold's (``--transport``: its transport; default fanfold's own choice: shared memory on
one host for gloo, the group's own transport for the fanfold backend), each on its own copy of the model from the
same seed, fed the same batches. A step is forward, backward and SGD step; a row's figure is the slowest rank's
median step time. After the timed steps the two DDP models' parameters must agree (allclose, rtol 1e-5, atol 1e-6):
the run fails otherwise.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fanfold

BACKENDS = ("gloo", "fanfold")
ROWS = ("bare model (no DDP)", "torch DDP", "fanfold DDP")
BATCH, WIDTH, BLOCKS = 32, 16, 200


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(BLOCKS) for m in (nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH))])


def one_run(backend: str, warmup: int, steps: int, transport: str | None, profile: int) -> dict:
    """In each worker: this rank's step times by row, the largest parameter difference between the two DDP models,
    and (rank 0, ``profile`` > 0) the cProfile report of ``profile`` more fanfold DDP steps."""
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    models = {
        ROWS[0]: build(),
        ROWS[1]: nn.parallel.DistributedDataParallel(build()),
        ROWS[2]: fanfold.DistributedDataParallel(build(), **({"transport": transport} if transport else {})),
    }
    opts = {row: torch.optim.SGD(m.parameters(), lr=0.01) for row, m in models.items()}
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, every row the same batches
    batches = [(torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen))
               for _ in range(8)]

    def step(row: str, k: int) -> None:
        x, y = batches[k % len(batches)]
        loss = F.mse_loss(models[row](x), y)
        opts[row].zero_grad(set_to_none=True)
        loss.backward()
        opts[row].step()

    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for k in range(warmup + steps):
        for row in ROWS:
            t0 = time.perf_counter()
            step(row, k)
            if k >= warmup:
                times[row].append(time.perf_counter() - t0)
    theirs, ours = models[ROWS[1]].module, models[ROWS[2]].module
    diff = max((a - b).abs().max().item() for a, b in zip(theirs.parameters(), ours.parameters()))
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(theirs.parameters(), ours.parameters()))
    report = ""
    if profile:
        prof = cProfile.Profile()
        for k in range(profile):
            if rank == 0:
                prof.enable()
            step(ROWS[2], k)
            if rank == 0:
                prof.disable()
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
            report = out.getvalue()
    models.clear()  # torch's DDP goes before its group: destroying the group under it can hang (docs/ddp-compat.md)
    del theirs, ours
    dist.destroy_process_group()
    return {"times": times, "diff": diff, "close": close, "profile": report}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocator, bucket rebuild)")
    p.add_argument("--quick", action="store_true", help="1 warm-up + 5 timed steps: checks the set-up and results")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: gloo, fanfold (default both)")
    p.add_argument("--transport", default=None, help="fanfold DDP's transport: torch or shm (default: its choice)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the timed steps, cProfile this many fanfold DDP steps on rank 0 and print the top 25")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch before giving up")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup = 5, 1
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if any(b not in BACKENDS for b in backends) or args.steps < 1 or args.warmup < 0 or args.profile < 0:
        p.error(f"--backends takes {BACKENDS}; --steps >= 1, --warmup >= 0, --profile >= 0")
    load = os.getloadavg()[0]
    results = {}
    for backend in backends:
        # The parent computes nothing: the workers are forked from it (one_run lives in __main__).
        per_rank = fanfold.launch(one_run, backend, args.warmup, args.steps, args.transport, args.profile,
                                  nprocs=2, threads=1, timeout=args.timeout)
        results[backend] = per_rank
        if per_rank[0]["profile"]:
            print(f"--- cProfile, rank 0, {args.profile} fanfold DDP steps on {backend} ---\n{per_rank[0]['profile']}")
    params = sum(q.numel() for q in build().parameters())
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 2 ranks x 1 thread; model "
          f"{BLOCKS} x (Linear({WIDTH}, {WIDTH}) + LayerNorm({WIDTH})): {len(list(build().parameters()))} parameter "
          f"tensors, {params} parameters; batch {BATCH} per rank; {args.steps} steps (+{args.warmup} warm-up); "
          f"fanfold DDP transport={args.transport or 'default'}; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after\n")
    print("| backend | row | step (ms, median, slowest rank) | fanfold / torch |")
    print("|---|---|---|---|")
    failed = []
    for backend, per_rank in results.items():
        med = {row: max(statistics.median(r["times"][row]) for r in per_rank) for row in ROWS}
        for row in ROWS:
            ratio = f"**{med[ROWS[2]] / med[ROWS[1]]:.3f}**" if row == ROWS[2] else ""
            print(f"| {backend} | {row} | {1e3 * med[row]:.3f} | {ratio} |")
        if not all(r["close"] for r in per_rank):
            failed.append(backend)
    print()
    for backend, per_rank in results.items():
        diff = max(r["diff"] for r in per_rank)
        ok = all(r["close"] for r in per_rank)
        print(f"{backend}: fanfold DDP and torch DDP parameters after the run: max |difference| {diff:.3g}, "
              f"allclose: {ok}")
    if failed:
        print(f"FAILED: fanfold DDP's parameters differ from torch DDP's on {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
