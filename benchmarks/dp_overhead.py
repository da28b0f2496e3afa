"""DataParallel overhead on the CPU: bare module vs fanfold.DataParallel vs torch.nn.DataParallel, one run.

    .venv/bin/python benchmarks/dp_overhead.py            # or: make bench
    .venv/bin/python benchmarks/dp_overhead.py --quick    # fewer repetitions

Prints markdown tables of median times: a forward call of the tutorial model (Linear(5, 2), batch 30) and a training
step (forward, backward, SGD step) of a ~16.8M-parameter MLP (2048 -> 4096 -> 2048) at batch 128 to 2048,
with 1 and 2 CPU replicas. The process uses 2 intra-op threads (the bare module's), the replicas' worker threads 1
each (fanfold's default: the caller's count divided by the number of replicas). With 2 replicas two fanfold
columns: the default, whose replicas run backward in their workers (``parallel_backward=True``), and
``parallel_backward=False``, where autograd runs the replicas' backward one after the other on the caller's thread.
Configurations are timed round-robin, so that load from other processes hits them alike. torch.nn.DataParallel has
no CPU replicas: without GPUs it just calls the module, so its column measures that call.

The last table isolates the cost that remains: one weight gradient of the MLP (4096 x 2048) as the bare module
computes it (one product over the whole batch, 2 threads) and as 2 replicas do (two half-batch products at once, 1
thread each, then summed), each with a freshly allocated output (as autograd does) and into a reused one.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import fanfold


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048))


def forward_call(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model(x)
    return run


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return run


def weight_gradient(batch: int) -> dict[str, Callable[[], None]]:
    """The MLP's first weight gradient, dY^T @ X, computed whole (bare) and as two half-batch products (2 replicas)."""
    dy, x = torch.randn(batch, 4096), torch.randn(batch, 2048)
    halves = [(a.contiguous(), b.contiguous()) for a, b in zip(dy.chunk(2), x.chunk(2))]
    pool = fanfold.WorkerPool(threads_per_worker=1)
    out, outs = torch.empty(4096, 2048), [torch.empty(4096, 2048) for _ in range(2)]

    def whole_fresh() -> None:
        dy.t().mm(x)

    def whole_reused() -> None:
        torch.mm(dy.t(), x, out=out)

    def halves_fresh() -> None:
        (_, a), (_, b) = pool.run([lambda h=h: h[0].t().mm(h[1]) for h in halves])
        a.add_(b)

    def halves_reused() -> None:
        pool.run([lambda h=h, o=o: torch.mm(h[0].t(), h[1], out=o) for h, o in zip(halves, outs)])
        outs[0].add_(outs[1])

    return {"whole_fresh": whole_fresh, "whole_reused": whole_reused,
            "halves_fresh": halves_fresh, "halves_reused": halves_reused}


def medians(fns: dict[str, Callable[[], None]], repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each fn, timed round-robin."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    small_n, big_n, bigger_n = (500, 5, 3) if args.quick else (3000, 25, 11)

    tiny = nn.Linear(5, 2)
    x_tiny = torch.randn(30, 5)
    tiny_t = medians({
        "bare": forward_call(tiny, x_tiny),
        "fanfold1": forward_call(fanfold.DataParallel(tiny, ["cpu"]), x_tiny),
        "fanfold2": forward_call(fanfold.DataParallel(tiny, ["cpu"] * 2), x_tiny),
        "torch": forward_call(nn.DataParallel(tiny), x_tiny),
    }, small_n, 50)

    big = mlp()
    mlp_t = {}
    for batch, steps in ((128, big_n), (512, bigger_n), (1024, bigger_n), (2048, bigger_n)):
        x, y = torch.randn(batch, 2048), torch.randn(batch, 2048)
        fns = {
            "bare": train_step(big, x, y),
            "fanfold2": train_step(fanfold.DataParallel(big, ["cpu"] * 2), x, y),
            "fanfold2_autograd": train_step(fanfold.DataParallel(big, ["cpu"] * 2, parallel_backward=False), x, y),
        }
        if batch == 128:
            fns["fanfold1"] = train_step(fanfold.DataParallel(big, ["cpu"]), x, y)
            fns["torch"] = train_step(nn.DataParallel(big), x, y)
        mlp_t[batch] = medians(fns, steps, 2)
    gemm_t = medians(weight_gradient(128), big_n, 2)

    params = sum(p.numel() for p in big.parameters())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, median of {small_n} calls / "
          f"{big_n} steps at batch 128 / {bigger_n} steps at larger batches\n")
    print("| workload | CPU replicas | bare module | fanfold.DataParallel | fanfold, parallel_backward=False | "
          "torch.nn.DataParallel* | fanfold / bare |")
    print("|---|---|---|---|---|---|---|")

    def row(name: str, n: int, t: dict, ours: str, serial: str | None) -> None:
        print(f"| {name} | {n} | {fmt(t['bare'])} | {fmt(t[ours])} | {fmt(t[serial]) if serial else '-'} | "
              f"{fmt(t['torch']) if 'torch' in t else '-'} | {t[ours] / t['bare']:.2f}x |")

    row("tutorial Linear(5, 2), forward, batch 30", 1, tiny_t, "fanfold1", None)
    row("tutorial Linear(5, 2), forward, batch 30", 2, tiny_t, "fanfold2", None)
    name = f"MLP {params / 1e6:.1f}M params, train step"
    row(f"{name}, batch 128", 1, mlp_t[128], "fanfold1", None)
    for batch, t in mlp_t.items():
        row(f"{name}, batch {batch}", 2, t, "fanfold2", "fanfold2_autograd")
    print("\n*torch.nn.DataParallel cannot run CPU replicas: without GPUs it calls the module directly, whatever the "
          "replica count.")
    print(f"\nfanfold per-call overhead with one device: {fmt(tiny_t['fanfold1'] - tiny_t['bare'])} (target < 50 us); "
          "2-replica MLP step / bare 2-thread step (target <= 1.00): "
          + ", ".join(f"{t['fanfold2'] / t['bare']:.2f} at batch {b}" for b, t in mlp_t.items()))
    print("\nOne 4096 x 2048 weight gradient at batch 128: whole batch, 2 threads (bare) vs two half-batch products "
          "at once, 1 thread each, then summed in place (2 replicas)\n")
    print("| output memory | bare: one product, K=128 | 2 replicas: two products, K=64, + sum |")
    print("|---|---|---|")
    for kind, label in (("fresh", "freshly allocated (autograd)"), ("reused", "reused")):
        print(f"| {label} | {fmt(gemm_t['whole_' + kind])} | {fmt(gemm_t['halves_' + kind])} |")


if __name__ == "__main__":
    main()
