"""All-reduce bandwidth on one host: gloo vs fanfold's shared-memory transport, with a plain copy as the ceiling.

    .venv/bin/python benchmarks/allreduce.py                      # 2 ranks x 1 thread, 4 KB .. 256 MB
    .venv/bin/python benchmarks/allreduce.py --nprocs 3 --max-size 64M

Each rank all-reduces a float32 tensor of each size (bytes) several times; the figure is the median over
repetitions of the slowest rank. algbw = size / time; busbw = algbw * 2 (n - 1) / n (the bytes each rank moves in a
ring or reduce-scatter/all-gather, NCCL's convention), so it compares with the copy ceiling: one tensor copy of
``size`` bytes per rank, all ranks copying at once. "shm" all-reduces an ordinary (private) tensor with the
transport's defaults: above a quarter chunk each rank sums its shard from the peers' own memory (process_vm_readv)
and copies the other shards from theirs, where the machine allows it (what DDP's gradients take); "shm ring" the
same tensor without peer reads (copied into the transport's ring of shared areas); "shm in place" a second ordinary
tensor reduced in place (the transport has no memory of its own to hand out: the same path as "shm"). The CPU
columns are the median CPU time one operation cost rank 0's process (all threads): the transport's own cost, less
sensitive than wall time to other load on the machine.
Prints a markdown table; writes a PNG plot (``--plot``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fanfold
from fanfold.collectives import ShmTransport


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def _human(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _time(fn, reps: int) -> tuple[float, float]:
    """Median seconds of ``fn`` on the slowest rank (every rank starts each repetition together), and the median
    CPU seconds it cost that rank's process (all its threads)."""
    fn()  # warm-up: page faults, first-touch of buffers
    times, cpu = [], []
    for _ in range(reps):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        cpu.append(time.process_time() - c0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times), statistics.median(cpu)


def _rank_main(sizes: list[int], chunk_bytes: int) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    shm = ShmTransport(timeout=120, chunk_bytes=chunk_bytes)
    ring = ShmTransport(timeout=120, chunk_bytes=chunk_bytes, peer_read=False)
    out = {"peer read": shm.peer_read}
    for size in sizes:
        x = torch.ones(size // 4)
        y = torch.empty_like(x)
        z = torch.ones(size // 4)
        reps = max(5, min(200, (64 << 20) // size))
        out[size] = {
            "gloo": _time(lambda x=x: dist.all_reduce(x), reps),
            "shm": _time(lambda x=x: shm.all_reduce(x).wait(), reps),
            "shm ring": _time(lambda x=x: ring.all_reduce(x).wait(), reps),
            "shm in place": _time(lambda z=z: shm.all_reduce(z).wait(), reps),
            "copy": _time(lambda x=x, y=y: y.copy_(x), reps),
        }
        del x, y, z
    shm.close()
    ring.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--min-size", default="4K")
    p.add_argument("--max-size", default="256M")
    p.add_argument("--chunk-bytes", default="1M", help="the shm transport's pipelining chunk")
    p.add_argument("--plot", default="docs/allreduce.png", help="PNG to write ('' for none)")
    args = p.parse_args(argv)
    sizes, s = [], _parse_size(args.min_size)
    while s <= _parse_size(args.max_size):
        sizes.append(s)
        s *= 4
    n = args.nprocs
    t0 = time.time()
    res = fanfold.launch(_rank_main, sizes, _parse_size(args.chunk_bytes), nprocs=n, timeout=3600)[0]
    factor = 2 * (n - 1) / n
    print(f"all_reduce, float32, {n} ranks x 1 thread, torch {torch.__version__}, {os.cpu_count()} CPUs, peer reads "
          f"{'on' if res['peer read'] else 'NOT ALLOWED here (shm = ring)'} ({time.time() - t0:.0f} s)\n")
    print("| size | gloo busbw GB/s | shm busbw GB/s | shm/gloo | ring busbw GB/s | ring/gloo | in place busbw GB/s "
          "| in place/gloo | copy GB/s | gloo CPU ms | shm CPU ms | ring CPU ms | in place CPU ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for size in sizes:
        r = res[size]
        g, m, w, z, c = (size / r[k][0] / 1e9 for k in ("gloo", "shm", "shm ring", "shm in place", "copy"))
        rows.append((size, g * factor, m * factor, w * factor, z * factor, c))
        print(f"| {_human(size)} | {g * factor:.2f} | {m * factor:.2f} | {m / g:.1f}x | {w * factor:.2f} | "
              f"{w / g:.1f}x | {z * factor:.2f} | {z / g:.1f}x | {c:.1f} | {r['gloo'][1] * 1e3:.2f} | "
              f"{r['shm'][1] * 1e3:.2f} | {r['shm ring'][1] * 1e3:.2f} | {r['shm in place'][1] * 1e3:.2f} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        xs = [row[0] for row in rows]
        for i, label in ((1, "gloo (busbw)"), (2, "fanfold shm: private tensor, peer reads (busbw)"),
                         (3, "fanfold shm: private tensor, ring (busbw)"),
                         (4, "fanfold shm: second tensor, in place (busbw)"), (5, "tensor copy (ceiling)")):
            ax.plot(xs, [row[i] for row in rows], marker="o", label=label, linestyle="--" if i == 5 else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [_human(x) for x in xs], rotation=45, fontsize=8)
        ax.set_xlabel("all_reduce size (float32)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"all_reduce bandwidth, {n} ranks on one host")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
