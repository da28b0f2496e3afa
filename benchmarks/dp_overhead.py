"""DataParallel overhead on the CPU: bare module vs fanfold.DataParallel vs torch.nn.DataParallel, one run.

    .venv/bin/python benchmarks/dp_overhead.py            # or: make bench
    .venv/bin/python benchmarks/dp_overhead.py --quick    # fewer repetitions

Prints a markdown table of median times: a forward call of the tutorial model (Linear(5, 2), batch 30) and a training
step (forward, backward, SGD step) of a ~16.8M-parameter MLP (2048 -> 4096 -> 2048, batch 128), each with 1 and 2
CPU replicas. The process uses 2 intra-op threads (the bare module's), the replicas' worker threads 1 each
(fanfold's default: the caller's count divided by the number of replicas). Configurations are timed round-robin,
so that load from other processes hits them alike. torch.nn.DataParallel has no CPU replicas: without GPUs it
just calls the module, so its column measures that call. The last line adds two comparisons: 2 intra-op threads
per replica worker instead of 1, and ``parallel_backward_bound``, what a parallel backward could reach at best.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import fanfold


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048))


class Oversubscribed(fanfold.DataParallel):
    """2 intra-op threads per replica worker (4 OpenMP threads on the caller's 2): why fanfold's default is 1."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pool = fanfold.WorkerPool(threads_per_worker=2)

    def parallel_apply(self, replicas, inputs, kwargs):  # the verb a subclass may swap
        return fanfold.parallel_apply(replicas, inputs, kwargs, self.device_ids[: len(replicas)], pool=self.pool)


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


def parallel_backward_bound(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """Not fanfold: an upper bound for CPU replicas. Two threads (1 intra-op thread each) run forward AND backward of
    half the batch on their own copy of the parameters, then the gradients are summed. DataParallel cannot do this
    with autograd's engine, which runs all CPU backward work on the thread that called backward()."""
    copies = [copy.deepcopy(model) for _ in range(2)]
    halves = list(zip(x.chunk(2), y.chunk(2)))
    pool = fanfold.WorkerPool(threads_per_worker=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def half(i: int) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            (xh, yh), m = halves[i], copies[i]
            loss = nn.functional.mse_loss(m(xh), yh, reduction="sum") / y.numel()
            return list(torch.autograd.grad(loss, list(m.parameters())))
        return run

    def run() -> None:
        (_, a), (_, b) = pool.run([half(0), half(1)])
        for p, ga, gb in zip(model.parameters(), a, b):
            p.grad = ga.add_(gb)
        opt.step()
    return run


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
    small_n, big_n = (500, 5) if args.quick else (3000, 25)

    tiny = nn.Linear(5, 2)
    x_tiny = torch.randn(30, 5)
    tiny_t = medians({
        "bare": forward_call(tiny, x_tiny),
        "fanfold1": forward_call(fanfold.DataParallel(tiny, ["cpu"]), x_tiny),
        "fanfold2": forward_call(fanfold.DataParallel(tiny, ["cpu"] * 2), x_tiny),
        "torch": forward_call(nn.DataParallel(tiny), x_tiny),
    }, small_n, 50)

    big = mlp()
    oversubscribed = Oversubscribed(big, ["cpu"] * 2)
    x, y = torch.randn(128, 2048), torch.randn(128, 2048)
    big_t = medians({
        "bare": train_step(big, x, y),
        "fanfold1": train_step(fanfold.DataParallel(big, ["cpu"]), x, y),
        "fanfold2": train_step(fanfold.DataParallel(big, ["cpu"] * 2), x, y),
        "torch": train_step(nn.DataParallel(big), x, y),
        "fanfold2_oversubscribed": train_step(oversubscribed, x, y),
        "bound": parallel_backward_bound(big, x, y),
    }, big_n, 3)

    params = sum(p.numel() for p in big.parameters())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, median of {small_n} calls / "
          f"{big_n} steps\n")
    print("| workload | CPU replicas | bare module | fanfold.DataParallel | torch.nn.DataParallel* | fanfold - bare |")
    print("|---|---|---|---|---|---|")
    for name, t in ((f"tutorial Linear(5, 2), forward, batch 30", tiny_t),
                    (f"MLP {params / 1e6:.1f}M params, train step, batch 128", big_t)):
        for n in (1, 2):
            ours = t[f"fanfold{n}"]
            print(f"| {name} | {n} | {fmt(t['bare'])} | {fmt(ours)} | {fmt(t['torch'])} | "
                  f"{'+' if ours >= t['bare'] else '-'}{fmt(abs(ours - t['bare']))} ({ours / t['bare']:.2f}x) |")
    print("\n*torch.nn.DataParallel cannot run CPU replicas: without GPUs it calls the module directly, whatever the "
          "replica count.")
    print(f"\nfanfold per-call overhead with one device: {fmt(tiny_t['fanfold1'] - tiny_t['bare'])} (target < 50 us); "
          f"2-replica MLP step / bare 2-thread step: {big_t['fanfold2'] / big_t['bare']:.2f} (target <= 1.00); "
          f"with 2 threads per replica worker instead of 1: {fmt(big_t['fanfold2_oversubscribed'])}; "
          f"bound with a parallel backward (not fanfold, see parallel_backward_bound): {fmt(big_t['bound'])} "
          f"({big_t['bound'] / big_t['bare']:.2f}x bare)")


if __name__ == "__main__":
    main()
