"""One rank of a multi-host test, started in its simulated host by ``tests/multihost`` (torchrun's environment:
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). ``python worker.py SCENARIO OUT_DIR [ARGS]``; each rank
writes what it saw to ``OUT_DIR/rank<R>.pt`` for the test to compare with its oracle.

Scenarios: ``collectives`` (every collective through the ``fanfold`` backend, fanfold's own transports and a gloo
group over the same ranks), ``ddp`` (fanfold's DDP over gloo, or torch's DDP, FSDP2 or HSDP over the ``fanfold``
backend: final parameters), ``kill`` (a rank on the last host kills itself before a step; the others'
StallError), ``link`` (an all_reduce that the test cuts by taking the link down; every rank's StallError),
``tx_bytes`` (the bytes of one all_reduce and of one reduce_scatter on the link).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared models

import fanfold  # noqa: E402  (registers the backend)
from _ddp_models import batch, loss_fn, mlp, optimizer, shard  # noqa: E402
from fanfold.collectives import resolve_transport  # noqa: E402
from fanfold.collectives.stall import group_transport  # noqa: E402

GLOBAL_BATCH = 12
_LINGER = 300.0  # divisible by every world size of the tests (2, 3, 4)
STEPS = 3


def _rank_tensor(seed: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def collectives(out: dict) -> None:
    """Each collective through four routes: the ``fanfold`` backend's group (torch's API), a gloo group (the
    oracle), fanfold's transport of each (what fanfold's DDP and ZeRO take). Barriers: the last rank arrives 1 s
    late; the others record how long they waited."""
    dist.init_process_group("fanfold", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    routes = {
        "backend": dist.group.WORLD,
        "gloo": gloo,
        "own(backend)": resolve_transport(None, dist.group.WORLD),
        "own(gloo)": resolve_transport(None, gloo),
    }
    out["hostname"], out["transports"] = os.uname().nodename, {k: type(v).__name__ for k, v in routes.items()}
    # 5 elements: below every size threshold; 6 * 2**18 (6 MiB of float32): above them, divisible by 2 and 3
    cases = [(5 * world, torch.float32), (6 * 2**18, torch.float32), (6 * 2**10, torch.int64)]
    for name, route in routes.items():
        own = not isinstance(route, dist.ProcessGroup)
        res = out[name] = {}
        for numel, dtype in cases:
            key = f"{numel}/{str(dtype).split('.')[1]}"
            x = _rank_tensor(rank, numel, dtype)
            t = x.clone()
            (route.all_reduce(t).wait() if own else dist.all_reduce(t, group=route))
            res[f"all_reduce/{key}"] = t
            if dtype.is_floating_point:
                t = x.clone()
                if own:
                    route.all_reduce(t, divisor=world).wait()
                elif name == "gloo":  # gloo has no AVG: the oracle is the sum, then the division
                    dist.all_reduce(t, group=route)
                    t /= world
                else:
                    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=route)
                res[f"all_reduce_avg/{key}"] = t
            for src in (0, world - 1):
                t = x.clone()
                (route.broadcast(t, src) if own else dist.broadcast(t, src, group=route))
                res[f"broadcast{src}/{key}"] = t
            gathered = torch.empty(world * numel, dtype=dtype)
            if own:
                route.all_gather(x.clone(), gathered).wait()
            elif name == "gloo":
                parts = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(parts, x.clone(), group=route)
                gathered = torch.cat(parts)
            else:
                dist.all_gather_into_tensor(gathered, x.clone(), group=route)
            res[f"all_gather/{key}"] = gathered
            part = torch.empty(numel // world, dtype=dtype)
            if own:
                route.reduce_scatter(x.clone(), part).wait()
            elif name == "gloo":  # the oracle: the whole sum, this rank's part of it
                t = x.clone()
                dist.all_reduce(t, group=route)
                part = t[rank * part.numel():(rank + 1) * part.numel()].clone()
            else:
                dist.reduce_scatter_tensor(part, x.clone(), group=route)
            res[f"reduce_scatter/{key}"] = part
        if rank == world - 1:
            time.sleep(1.0)
        start = time.monotonic()
        (route.barrier() if own else dist.barrier(group=route))
        res["barrier_wait_s"] = time.monotonic() - start
    finish(out)


def ddp(out: dict, which: str) -> None:
    """``STEPS`` SGD steps on this rank's shard of each global batch: ``which`` is "fanfold" (fanfold's DDP, gloo
    init), "torch" (torch's DDP on the ``fanfold`` backend), "fsdp2" (torch's FSDP2 over the whole ``fanfold``
    group) or "hsdp" (FSDP2 on a 2-D mesh: shard inside a host, replicate across; hosts of equal size)."""
    dist.init_process_group("gloo" if which == "fanfold" else "fanfold", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp()
    if which == "fanfold":
        wrapped = fanfold.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets: overlap exercised
    elif which == "torch":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.01)
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        if which == "fsdp2":
            mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        else:  # ranks 0..L-1 on the first host, L..2L-1 on the second (tests/multihost/hosts.py)
            local = int(os.environ["LOCAL_WORLD_SIZE"])
            mesh = DeviceMesh("cpu", [list(range(h * local, (h + 1) * local)) for h in range(world // local)],
                              mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = optimizer(model)
    for step in range(STEPS):
        x, y = batch("mlp", step, GLOBAL_BATCH)
        opt.zero_grad()
        loss_fn("mlp", wrapped(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    # FSDP2's parameters are DTensors: full_tensor() gathers them (torch's functional all-gather)
    out["params"] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for p in model.parameters()]
    out["transport"] = type(dist.group.WORLD.transport).__name__ if which != "fanfold" else None
    if which == "hsdp":  # each group's transport, made at its first collective
        out["mesh groups"] = [type(mesh.get_group(d).transport).__name__ for d in ("shard", "replicate")]
    finish(out)


def kill(out: dict) -> None:
    """fanfold's DDP; the last rank (on the last host) kills itself before step 1's backward."""
    dist.init_process_group("gloo", timeout=_pg_timeout())
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp()
    wrapped = fanfold.DistributedDataParallel(model)
    opt = optimizer(model)
    for step in range(2):
        x, y = batch("mlp", step, GLOBAL_BATCH)
        opt.zero_grad()
        loss = loss_fn("mlp", wrapped(shard(x, rank, world)), shard(y, rank, world))
        if step == 1 and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        _diagnosed(out, lambda: (loss.backward(), opt.step()))
        if out["error"]:
            break
    finish(out, survivors=world - 1)


def link(out: dict, ready: str) -> None:
    """A 64 MiB all_reduce through fanfold's inspected transport; ``ready`` (a file) tells the test it started."""
    dist.init_process_group("gloo", timeout=_pg_timeout())
    transport = group_transport(None, feature="multihost test")
    transport.all_reduce(torch.ones(4)).wait()  # connections made before the clock starts
    t = torch.ones(16 * 2**20)
    if dist.get_rank() == 0:
        open(ready, "w").close()
    _diagnosed(out, lambda: transport.all_reduce(t).wait())
    finish(out, survivors=dist.get_world_size())


def link_tx_bytes() -> int:
    """Bytes this host has sent on its link: the tx counter of its one interface besides loopback (this process's
    /sys is its host's network namespace's)."""
    devs = [d for d in os.listdir("/sys/class/net") if d != "lo"]
    if len(devs) != 1:
        raise RuntimeError(f"expected one link besides lo in this host, found {devs}")
    with open(f"/sys/class/net/{devs[0]}/statistics/tx_bytes") as f:
        return int(f.read())


def tx_bytes(out: dict, backend: str, mib: str) -> None:
    """One all_reduce of ``mib`` MiB of float32 on the ``backend`` group, then one reduce_scatter of as many;
    ``out["tx"]``, ``out["tx_reduce_scatter"]``: the bytes this host sent on its link meanwhile (each between two
    barriers; the same two barriers around nothing are subtracted)."""
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    t = torch.ones(int(float(mib) * 2**18))
    dist.all_reduce(torch.ones(world * 4))  # connections and transports made before counting
    dist.barrier()
    before = link_tx_bytes()
    dist.barrier()
    idle = link_tx_bytes() - before
    dist.barrier()
    before = link_tx_bytes()
    dist.all_reduce(t)
    dist.barrier()
    out["tx"] = link_tx_bytes() - before - idle
    out["bytes"], out["correct"] = t.numel() * 4, bool((t == world).all())
    part = torch.empty(t.numel() // world)
    before = link_tx_bytes()
    dist.reduce_scatter_tensor(part, torch.ones_like(t))
    dist.barrier()
    out["tx_reduce_scatter"] = link_tx_bytes() - before - idle
    out["correct"] &= bool((part == world).all())
    finish(out)


def _pg_timeout() -> timedelta:
    # the process group's timeout is also its store's: what each read of a peer's progress may wait
    return timedelta(seconds=float(os.environ.get("FANFOLD_TEST_PG_TIMEOUT", "60")))


def _diagnosed(out: dict, call) -> None:
    start = time.monotonic()
    try:
        call()
        out["error"] = None
    except Exception as exc:
        out["error"] = {"type": type(exc).__name__, "message": str(exc), "missing": getattr(exc, "missing", None),
                        "traceback": traceback.format_exc()}
    out["seconds"] = time.monotonic() - start


def finish(out: dict, survivors: int | None = None) -> None:
    """Save ``out`` and exit at once, while the scenario's objects are alive. Freeing them can hang: torch's DDP
    freed after its process group was destroyed joins gloo's worker thread while holding the GIL (seen with the
    ``fanfold`` backend delegating to gloo, about 1 run in 4), and a group whose peer died may block too.
    ``survivors``: after a fault, rank 0 (the store's host) stays until that many results are saved (at most
    ``_LINGER`` seconds), so that the others' diagnoses can still read the store."""
    out_dir = sys.argv[2]
    torch.save(out, os.path.join(out_dir, f"rank{out['rank']}.pt"))
    deadline = time.monotonic() + _LINGER
    while survivors and out["rank"] == 0 and time.monotonic() < deadline and len(
            [n for n in os.listdir(out_dir) if n.startswith("rank")]) < survivors:
        time.sleep(0.1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    scenario, _out_dir, *args = sys.argv[1:]
    torch.set_num_threads(1)
    # a rank still running by then prints every thread's stack into its log (the test's timeout report shows it)
    faulthandler.dump_traceback_later(float(os.environ.get("FANFOLD_TEST_DUMP_AFTER", "100")), exit=False)
    rank = int(os.environ["RANK"])
    out: dict = {"rank": rank}
    {"collectives": collectives, "ddp": ddp, "kill": kill, "link": link, "tx_bytes": tx_bytes}[scenario](out, *args)
    raise RuntimeError(f"scenario {scenario!r} returned without finish()")


if __name__ == "__main__":
    main()
