"""One Linear(width, width) layer's three products on micro-batches vs on the whole batch, one thread (CPU).

    .venv/bin/python benchmarks/pipeline_layer.py                      # width 2048, batch 512, 8 micro-batches
    .venv/bin/python benchmarks/pipeline_layer.py --batch 1024 --chunks 8

Why a pipeline of 2 stages stays below its ideal speed-up (``benchmarks/pipeline.py``): a stage's work on M
micro-batches costs more than its share of the work on the whole batch. Rows: the forward ``x @ W.T``, the input
gradient ``g @ W`` and the weight gradient ``g.T @ x`` (accumulated with ``addmm_``, as ``Pipeline.train_step``
does, and through a fresh tensor plus ``add_``, as autograd does), each summed over the micro-batches, against the
same product on the whole batch. Median of ``--repeats`` timings each; the summed results are checked against the
whole-batch products.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    g0 = torch.Generator().manual_seed(0)
    w = torch.randn(args.width, args.width, generator=g0)
    x = torch.randn(args.batch, args.width, generator=g0)
    g = torch.randn(args.batch, args.width, generator=g0)
    xs, gs = x.chunk(args.chunks), g.chunk(args.chunks)

    def addmm() -> torch.Tensor:
        acc = gs[0].t().mm(xs[0])
        for gi, xi in zip(gs[1:], xs[1:]):
            acc.addmm_(gi.t(), xi)
        return acc

    def fresh() -> torch.Tensor:
        acc = gs[0].t().mm(xs[0])
        for gi, xi in zip(gs[1:], xs[1:]):
            acc.add_(gi.t().mm(xi))
        return acc

    whole_w = g.t().mm(x)
    for name, got in (("addmm_", addmm()), ("fresh + add_", fresh())):
        if not torch.allclose(got, whole_w, rtol=1e-4, atol=1e-2):
            raise SystemExit(f"weight gradient by {name} differs from the whole batch's")
    rows = [
        ("forward x @ W.T", lambda: torch.nn.functional.linear(x, w),
         lambda: [torch.nn.functional.linear(xi, w) for xi in xs]),
        ("input gradient g @ W", lambda: g.mm(w), lambda: [gi.mm(w) for gi in gs]),
        ("weight gradient, addmm_", lambda: g.t().mm(x), addmm),
        ("weight gradient, fresh + add_ (autograd)", lambda: g.t().mm(x), fresh),
    ]
    print(f"torch {torch.__version__}, 1 thread; Linear({args.width}, {args.width}), batch {args.batch}, "
          f"{args.chunks} micro-batches of {xs[0].shape[0]} rows; medians of {args.repeats}\n")
    print("| product | whole batch (ms) | micro-batches, summed (ms) | ratio |")
    print("|---|---|---|---|")
    for name, whole, micro in rows:
        a, b = _timed(whole, args.repeats), _timed(micro, args.repeats)
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
