"""Collectives and DDP across 2 simulated hosts x 2 ranks on a link limited to 1 Gbit/s each way (root only).

    sudo .venv/bin/python benchmarks/multihost.py                 # 5 repeats (about 5 minutes on 2 cores)
    sudo .venv/bin/python benchmarks/multihost.py --repeats 3 --rate 1gbit --sizes 4,16,64 --steps 3

The hosts are those of the multi-host tests (``tests/multihost/hosts.py``: network, mount, UTS and PID namespaces
per host, one veth pair shaped by ``tc tbf``; docs/multihost.md). One launch of 4 ranks runs every row, interleaved
repeat by repeat so that other load falls on all rows alike:

- all_reduce of 4, 16 and 64 MB of float32 (normal values at a gradient's scale), and reduce_scatter of the largest:
  through the ``fanfold`` backend's group against a gloo group over the same ranks (every result checked);
- a training step (forward, backward, SGD) of the 16.7M-parameter MLP of ``benchmarks/ddp.py`` at batch 32 per rank:
  no gradient sync (each rank alone: the compute floor), torch's DDP over gloo, torch's DDP over the ``fanfold``
  backend, fanfold's DDP on the gloo group and on the ``fanfold`` group (replicas checked equal afterwards).

Each timed operation sits between two barriers; its time is the slowest rank's, its bytes what host 0 sent on its
link meanwhile (the veth's tx counter, /sys/class/net/<dev>/statistics), less the median of the same two barriers
around nothing (the idle baseline). Figures are medians over the repeats (x the timed steps for DDP). Next to them,
the arithmetic for S bytes all-reduced, H hosts of L ranks: a flat ring sends 2S(HL-1)/(HL) through each host's
link, the hierarchical path 2S(H-1)/H (a reduce_scatter: half of each).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "multihost"))  # the simulated hosts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hosts import Hosts, Link, unavailable, wait_ranks  # noqa: E402

HOSTS, LOCAL = 2, 2
BATCH = 32
DDP_ROWS = ["no gradient sync", "torch DDP (gloo)", "torch DDP (fanfold backend)", "fanfold DDP (gloo group)",
            "fanfold DDP (fanfold group)"]


def link_tx_bytes() -> int:
    devs = [d for d in os.listdir("/sys/class/net") if d != "lo"]
    if len(devs) != 1:
        raise RuntimeError(f"expected one link besides lo in this host, found {devs}")
    with open(f"/sys/class/net/{devs[0]}/statistics/tx_bytes") as f:
        return int(f.read())


def _measured(fn, gloo) -> tuple[float, int]:
    """Seconds of ``fn()`` on this rank and the bytes this host sent meanwhile, between two barriers."""
    dist.barrier(group=gloo)
    tx = link_tx_bytes()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    dist.barrier(group=gloo)
    return seconds, link_tx_bytes() - tx


def _values(numel: int, rank: int, world: int, want: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's input, values of a gradient's scale (not constants: the two-host path packs the bytes it sends,
    and constants would pack far better than gradients), and the sum over the ranks' inputs."""
    def one(r: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(r)) * 1e-3

    return one(rank), sum(one(r) for r in range(world)) if want else None


def _wrap(row: str, model, gloo):
    import fanfold

    if row.startswith("torch DDP"):
        group = gloo if "gloo" in row else dist.group.WORLD
        return torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    if row.startswith("fanfold DDP"):
        group = gloo if "gloo" in row else dist.group.WORLD
        return fanfold.DistributedDataParallel(model, process_group=group)
    return model


def rank_main(out_dir: str, repeats: int, sizes: list[int], steps: int) -> None:
    """One rank: every row, ``repeats`` times, interleaved; writes {row: [(seconds, tx bytes), ...]} to
    ``out_dir/rank<R>.pt``."""
    sys.path.insert(0, str(HERE))
    from ddp import build

    torch.set_num_threads(1)
    dist.init_process_group("fanfold", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    res: dict[str, list] = {}
    for rep in range(repeats + 1):  # repeat 0 is a warm-up: connections, transports, first-touch of buffers
        for _ in range(3):
            res.setdefault("idle", []).append(_measured(lambda: None, gloo))
        for mb in sizes:
            _, want = _values(mb * 2**18, rank, world)
            for name, group in (("fanfold backend", dist.group.WORLD), ("gloo", gloo)):
                t, _ = _values(mb * 2**18, rank, world, want=False)
                got = _measured(lambda: dist.all_reduce(t, group=group), gloo)
                if not torch.allclose(t, want, rtol=1e-4, atol=1e-6):
                    raise RuntimeError(f"rank {rank}: all_reduce of {mb} MB through {name}: wrong sum")
                if rep:
                    res.setdefault(f"all_reduce {mb} MB|{name}", []).append(got)
        mb = max(sizes)
        part = torch.empty(mb * 2**18 // world)
        n = mb * 2**18 // world
        _, want = _values(mb * 2**18, rank, world)
        for name, group in (("fanfold backend", dist.group.WORLD), ("gloo", gloo)):
            t, _ = _values(mb * 2**18, rank, world, want=False)
            got = _measured(lambda: dist.reduce_scatter_tensor(part, t, group=group), gloo)
            if not torch.allclose(part, want[rank * n:(rank + 1) * n], rtol=1e-4, atol=1e-6):
                raise RuntimeError(f"rank {rank}: reduce_scatter of {mb} MB through {name}: wrong sum")
            if rep:
                res.setdefault(f"reduce_scatter {mb} MB|{name}", []).append(got)
        for row in DDP_ROWS:
            model, (x, y) = build("mlp")
            x, y = x[:BATCH], y[:BATCH]
            wrapped = _wrap(row, model, gloo)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)

            def step() -> None:
                loss = F.cross_entropy(wrapped(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            step()  # warm-up
            for _ in range(steps):
                got = _measured(step, gloo)
                if rep:
                    res.setdefault(f"DDP step|{row}", []).append(got)
            if row != "no gradient sync":  # the replicas must still be equal, bit for bit
                check = torch.cat([p.detach().reshape(-1)[:4096] for p in model.parameters()])
                ref = check.clone()
                dist.broadcast(ref, 0, group=gloo)
                if not torch.equal(check, ref):
                    raise RuntimeError(f"rank {rank}: {row}: parameters differ from rank 0's")
    res["params"] = sum(p.numel() for p in build("mlp")[0].parameters())
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # before teardown: freeing torch's DDP after the groups can hang (tests/multihost/worker.py)


def _arith(size: int, op: str) -> tuple[float, float]:
    h, n, times = HOSTS, HOSTS * LOCAL, 1 if op.startswith("reduce_scatter") else 2
    return times * size * (n - 1) / n, times * size * (h - 1) / h


def table(results: list[dict]) -> str:
    host0 = results[0]  # rank 0 is on host 0: its tx counts are host 0's
    idle = statistics.median(tx for _, tx in host0["idle"])
    keys = [k for k in host0 if "|" in k]
    lines = ["| operation | path | median ms | vs gloo / torch DDP (gloo) | host 0 tx MB (idle subtracted) | "
             "flat ring MB | hierarchical MB |", "|---|---|---:|---:|---:|---:|---:|"]
    medians = {}
    for key in keys:
        n = len(host0[key])
        slowest = [max(r[key][i][0] for r in results) for i in range(n)]
        medians[key] = statistics.median(slowest), statistics.median(tx for _, tx in host0[key]) - idle
    grad_bytes = 4 * results[0]["params"]
    for key in keys:
        op, path = key.split("|")
        collective = not op.startswith("DDP")
        base = medians[f"{op}|gloo"] if collective else medians[f"{op}|torch DDP (gloo)"]
        size = int(op.split()[1]) * 2**20 if collective else grad_bytes
        flat, hier = _arith(size, op) if path != "no gradient sync" else (0.0, 0.0)
        ms, tx = medians[key]
        lines.append(f"| {op} | {path} | {1e3 * ms:.0f} | {base[0] / ms:.2f}x | {tx / 1e6:.1f} | {flat / 1e6:.1f} | "
                     f"{hier / 1e6:.1f} |")
    return "\n".join(lines) + f"\n\nidle baseline (two barriers): {idle / 1e3:.1f} KB; MB = 10^6 bytes"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed DDP steps per row and repeat")
    p.add_argument("--sizes", default="4,16,64", help="all_reduce sizes in MB (2^20 bytes), comma-separated")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each direction of the link")
    p.add_argument("--rank", metavar="OUT_DIR", help=argparse.SUPPRESS)  # given to the ranks' processes
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.rank:
        rank_main(args.rank, args.repeats, sizes, args.steps)
        return 0
    reason = unavailable()
    if reason:
        print(f"benchmarks/multihost.py: {reason}", file=sys.stderr)
        return 2
    link = Link(rate=args.rate, burst="256kb", latency="50ms")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="fanfold-multihost-") as tmp, Hosts(HOSTS, link=link) as hosts:
        argv = [sys.executable, str(Path(__file__).resolve()), "--repeats", str(args.repeats), "--steps",
                str(args.steps), "--sizes", args.sizes, "--rank", tmp]
        wait_ranks(hosts.start_ranks([LOCAL] * HOSTS, argv, tmp), 3600)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(HOSTS * LOCAL)]
    print(f"## {HOSTS} simulated hosts x {LOCAL} ranks, link {link.rate} each way (tbf burst {link.burst}, latency "
          f"{link.latency}); commit {commit or '?'}; torch {torch.__version__}; {args.repeats} repeats, "
          f"{args.steps} DDP steps each\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
