"""The inner optimizer's step of fanfold's ZeRO, taken alone: torch.optim.Adam over one rank's slice of
benchmarks/zero.py's MLP (8.4M float32 elements in 4 views), stepped whole or in cache-sized pieces; one process,
one thread, CPU.

    .venv/bin/python benchmarks/zero_step.py                  # 200 steps per row, rows alternating in blocks of 10
    .venv/bin/python benchmarks/zero_step.py --numel 100000   # a small slice: the Python overhead of many pieces

Rows, for each implementation (``foreach=False``, torch's default on CPU; ``foreach=True``; ``fused=True``):

- whole: the inner optimizer over the 4 views, as before pieces;
- pieces, one group: the views cut into pieces of at most ``--piece-kib`` KiB, all in one parameter group;
- pieces, group each: one parameter group per piece, so each of the implementation's passes runs over one piece
  while it is in cache (what ``ZeroRedundancyOptimizer`` did until issue 25);
- pieces, step each: one parameter group, ``step()`` called once per piece with only that piece carrying ``.grad``.

Each row has its own parameters and state (same values); the table shows the median step time over every step of
that row and its ratio to the same implementation's whole row, all measured in the same run, rows interleaved.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

ROWS = ["whole", "pieces, one group", "pieces, group each", "pieces, step each"]
IMPLS = {"foreach=False": dict(foreach=False), "foreach=True": dict(foreach=True), "fused=True": dict(fused=True)}


def make_row(row: str, numel: int, piece: int, impl: dict) -> tuple:
    torch.manual_seed(0)
    sizes = [numel // 4] * 3 + [numel - 3 * (numel // 4)]
    flats = [torch.randn(n) for n in sizes]
    grads = [torch.randn(n) * 1e-3 for n in sizes]
    if row == "whole":
        views = [(f, g) for f, g in zip(flats, grads)]
    else:
        views = [(f[a:a + piece], g[a:a + piece]) for f, g in zip(flats, grads) for a in range(0, f.numel(), piece)]
    params = [v for v, _ in views]
    if row == "pieces, group each":
        opt = torch.optim.Adam([{"params": [p]} for p in params], lr=1e-4, **impl)
    else:
        opt = torch.optim.Adam(params, lr=1e-4, **impl)

    def step() -> None:
        if row == "pieces, step each":
            for p, g in views:
                p.grad = g
                opt.step()
                p.grad = None
        else:
            for p, g in views:
                p.grad = g
            opt.step()
    return step, flats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=8_380_000, help="elements in the slice (the MLP's half: 8.38M)")
    ap.add_argument("--piece-kib", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--impl", choices=list(IMPLS), action="append", help="default: all three")
    args = ap.parse_args()
    torch.set_num_threads(1)
    piece = args.piece_kib * 1024 // 4
    impls = args.impl or list(IMPLS)
    rows = {(i, r): make_row(r, args.numel, piece, IMPLS[i]) for i in impls for r in ROWS}
    times: dict = {k: [] for k in rows}
    for step, _ in rows.values():
        step()  # state allocated outside the timing
    for _ in range(0, args.steps, args.block):
        for k, (step, _) in rows.items():
            for _ in range(args.block):
                t = time.perf_counter()
                step()
                times[k].append(time.perf_counter() - t)
    for i in impls:  # every row did the same arithmetic: the same bits
        ref = rows[(i, "whole")][1]
        for r in ROWS:
            assert all(torch.equal(a, b) for a, b in zip(rows[(i, r)][1], ref)), (i, r)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"torch {torch.__version__}, Adam over {args.numel / 1e6:.2f}M float32 elements in 4 views, pieces of "
          f"{args.piece_kib} KiB, 1 thread; median of {args.steps} steps per row, rows alternating in blocks of "
          f"{args.block}; {when}; results bitwise equal across rows\n")
    print("| implementation | row | step (ms, median) | vs whole |\n|---|---|---|---|")
    for i in impls:
        base = statistics.median(times[(i, "whole")])
        for r in ROWS:
            t = statistics.median(times[(i, r)])
            print(f"| {i} | {r} | {1e3 * t:.2f} | {t / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
