"""ZeRO stage 2's two collectives on the shm transport, old way against new, alternating in one launch (2 ranks x 1
thread, CPU): the gradient reduction (all-reduce of the ``.grad`` tensors where they lie, then this rank's part copied
out, against ``reduce_scatter_tensors`` straight into the part) and the parameter gather (all_gather in place through
the ring, against reading the peers' parts from their outputs).

    .venv/bin/python benchmarks/zero_collectives.py            # 16.7M float32 (benchmarks/zero.py's MLP), 15 rounds

Each round times every row once, in turn (the same moment's load for all); the table shows each row's median over
the rounds and the same-round ratio new / old (median).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fanfold
from fanfold.collectives.shm.transport import ShmTransport


def one_run(numel: int, pieces: int, rounds: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    sizes = [numel // pieces] * pieces
    grads = [torch.randn(m) for m in sizes]
    total = sum(sizes)
    chunk = -(-total // n)
    part = torch.empty(chunk)
    flat = torch.randn(chunk * n)
    times: dict[str, list[float]] = {}
    with ShmTransport() as peers, ShmTransport(peer_read=False) as ring:
        assert peers.peer_read, "this machine forbids peer reads: nothing to compare"

        def old_reduce(gs: list[torch.Tensor]) -> None:
            peers.reduce_tensors(gs, divisor=n).wait()
            at, lo, hi = 0, r * chunk, min(total, (r + 1) * chunk)
            for g in gs:  # this rank's part out of the reduced tensors, as stage 2's _finish did
                a, b = max(lo, at), min(hi, at + g.numel())
                if a < b:
                    part[a - lo:b - lo].copy_(g[a - at:b - at])
                at += g.numel()

        def new_reduce(gs: list[torch.Tensor]) -> None:
            peers.reduce_scatter_tensors(gs, part, divisor=n).wait()

        rows = {"reduce: all-reduce in place + copy out": old_reduce, "reduce: reduce_scatter_tensors": new_reduce,
                "gather: ring, in place": lambda _: ring.all_gather(flat[r * chunk:][:chunk], flat).wait(),
                "gather: peer reads, in place": lambda _: peers.all_gather(flat[r * chunk:][:chunk], flat).wait()}
        for k in range(rounds + 1):
            for name, fn in rows.items():
                gs = [g.clone() for g in grads]  # fresh tensors, as autograd's .grad, made before the clock starts
                peers.barrier()
                ring.barrier()
                start = time.perf_counter()
                fn(gs)
                if k:  # round 0 warms up
                    times.setdefault(name, []).append(time.perf_counter() - start)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=16_737_000)
    p.add_argument("--pieces", type=int, default=10, help="gradient tensors (DDP: one per parameter of a bucket)")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    per_rank = fanfold.launch(one_run, args.numel, args.pieces, args.rounds, nprocs=2, threads=1, timeout=600)
    slowest = {name: [max(rk[name][i] for rk in per_rank) for i in range(args.rounds)] for name in per_rank[0]}
    print(f"torch {torch.__version__}, {args.numel / 1e6:.1f}M float32 in {args.pieces} tensors, 2 ranks x 1 thread, "
          f"{args.rounds} rounds (slowest rank per round, medians)\n")
    print("| row | ms (median) | new / old, same round (median) |\n|---|---|---|")
    names = list(slowest)
    for i, name in enumerate(names):
        ratio = "" if i % 2 == 0 else \
            f"{statistics.median(a / b for a, b in zip(slowest[name], slowest[names[i - 1]])):.3f}"
        print(f"| {name} | {1e3 * statistics.median(slowest[name]):.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
