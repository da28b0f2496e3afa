"""Where the shm transport's peer-read all-reduce spends its CPU, on the gradients of benchmarks/ddp.py's MLP.

    .venv/bin/python benchmarks/peer_profile.py              # 2 ranks x 1 thread, 12 steps (~10 s)

Each step all-reduces fresh tensors with the sizes of the 16.7M MLP's gradients, in DDP's three 25 MiB buckets
(averaged, only the last bucket settling, as DDP's reducer issues them), with nothing else running: the transport's
own cost, without backward competing for the cores. Rank 0's transport thread is profiled (cProfile on the
thread's CPU clock, around the algorithm only, so waiting for the peer does not count); the table gives per-step
CPU of the main entries: the kernel copies from the peer
(``process_vm_readv`` in ``_copy``), the float32 sums and the halving.
"""
from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fanfold
from fanfold.collectives import ShmTransport
from fanfold.distributed import shm_peer

# the MLP's weight and bias sizes (elements), grouped as DDP's reducer buckets them after the first backward
BUCKETS = [[2048 * 1000, 1000, 2048 * 2048, 2048], [2048 * 2048, 2048], [2048 * 2048, 2048, 1024 * 2048, 2048]]
STEPS = 12


def _rank() -> tuple[float, dict]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    transport = ShmTransport(timeout=60)
    if not transport.peer_read:
        raise SystemExit("this machine forbids process_vm_readv between the ranks: nothing to profile")
    profile, plain = cProfile.Profile(time.thread_time), shm_peer.PeerReader._round  # CPU, not waits

    def profiled(self, *args, **kwargs):  # runs on the transport's thread
        profile.enable()
        try:
            return plain(self, *args, **kwargs)
        finally:
            profile.disable()

    shm_peer.PeerReader._round = profiled
    times = []
    for _ in range(STEPS):
        grads = [[torch.randn(n) for n in bucket] for bucket in BUCKETS]
        dist.barrier()
        start = time.perf_counter()
        handles = [transport.reduce_tensors(g, bucket=b, divisor=2, settle=b == len(BUCKETS) - 1)
                   for b, g in enumerate(grads)]
        for h in handles:
            h.wait()
        times.append(time.perf_counter() - start)
    transport.close()
    stats = pstats.Stats(profile).stats
    per_step = {"total": 0.0}
    for (path, _, name), (_, _, tottime, _, _) in stats.items():
        per_step["total"] += tottime / STEPS
        key = {"_copy": "process_vm_readv (_copy)", "<built-in method torch.add>": "sums (torch.add)",
               "<method 'mul_' of 'torch._C.TensorBase' objects>": "halving (mul_)",
               "<method 'div_' of 'torch._C.TensorBase' objects>": "division (div_)"}.get(name)
        if key:
            per_step[key] = per_step.get(key, 0.0) + tottime / STEPS
    return statistics.median(times), per_step


def main() -> None:
    out = fanfold.launch(_rank, nprocs=2, timeout=300)
    megabytes = 4 * sum(sum(b) for b in BUCKETS) / 1e6
    print(f"peer-read all-reduce of {megabytes:.1f} MB in {len(BUCKETS)} buckets, 2 ranks x 1 thread, "
          f"torch {torch.__version__}; median step {1e3 * max(t for t, _ in out):.1f} ms (slower rank)\n")
    print("| rank 0's transport thread, per step | CPU ms |\n|---|---:|")
    for key, value in sorted(out[0][1].items(), key=lambda kv: -kv[1]):
        print(f"| {key} | {1e3 * value:.1f} |")


if __name__ == "__main__":
    main()
