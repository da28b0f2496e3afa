"""The ``fanfold`` torch.distributed backend, 2 ranks, against gloo as the oracle: every collective (the shared-memory
ones and the delegated ones) gives gloo's result; torch's DDP, ZeroRedundancyOptimizer and FSDP2 train to gloo's
parameters; Work objects, errors, bounded waits, subgroups, the peer-read permission and /dev/shm cleanup."""
import ctypes
import errno
import time
import warnings
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fanfold
from fanfold.collectives.shm import engine as shm_peer

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32]
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT]


def _x(shape, r, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * seed + 17 * r + 1))
    return x.to(dtype) if dtype.is_floating_point else (x * 10).round().to(dtype)


def _init():
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo")


def _delegated(r, n, group):
    """The collectives gloo runs for the fanfold backend, on ``group``: their outputs by name."""
    x = _x((4, 3), r, torch.float32)
    gathered = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(gathered, x, group=group)
    into, scattered, swapped = torch.empty(n * 4, 3), torch.empty(2, 3), torch.empty(4, 3)
    dist.all_gather_into_tensor(into, x, group=group)
    dist.reduce_scatter_tensor(scattered, _x((n * 2, 3), r, torch.float32), group=group)
    dist.all_to_all_single(swapped, x, group=group)
    return {"all_gather": gathered, "all_gather_into_tensor": [into], "reduce_scatter_tensor": [scattered],
            "all_to_all_single": [swapped]}


def _collectives():
    r, n, gloo = _init()
    out = {"name": dist.get_backend(), "mismatch": []}
    for dtype in DTYPES:
        for op in OPS:
            if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            for shape in [(1,), (3, 5), (40000,)]:
                x = _x(shape, r, dtype, seed=len(out["mismatch"]))
                got, want = x.clone(), x.clone()
                if op == dist.ReduceOp.AVG:  # gloo has no AVG: its sum, divided in the tensor's dtype
                    dist.all_reduce(want, group=gloo)
                    want = want / n
                else:
                    dist.all_reduce(want, op=op, group=gloo)
                work = dist.all_reduce(got, op=op, async_op=True)
                work.wait()
                # get_future().done(): an async Work still in flight at return is torch's holder of fanfold's, whose
                # is_completed() is the holder's own (docs/backend.md, Semantics)
                if not (work.get_future().done() and work.get_future().wait()[0] is got and torch.equal(got, want)):
                    out["mismatch"].append((str(dtype), str(op), shape))
    out["shm"] = dist.group.WORLD.transport is not None
    # non-contiguous: summed through a contiguous copy, written back in place
    x = _x((6, 4), r, torch.float32).t()
    want = x.contiguous()
    dist.all_reduce(want, group=gloo)
    dist.all_reduce(x)
    out["strided"] = torch.equal(x, want)
    # Parameters (autograd leaves) and empty and 0-d tensors: their data are reduced as gloo does
    odd = {}
    for name, make in {"parameter": lambda: nn.Parameter(_x((5,), r, torch.float32)),
                       "empty": lambda: torch.empty(0), "0-d": lambda: _x((), r, torch.float64)}.items():
        a, b, c, d, e, f = (make() for _ in range(6))
        dist.all_reduce(a)
        dist.all_reduce(b, group=gloo)
        dist.broadcast(c, src=1)
        dist.broadcast(d, src=1, group=gloo)
        # (gloo's coalesced all-reduce refuses a Parameter: detached here for both)
        dist.all_reduce_coalesced([e.detach(), a.detach().clone()])
        dist.all_reduce_coalesced([f.detach(), a.detach().clone()], group=gloo)
        odd[name] = torch.equal(a, b) and torch.equal(c, d) and torch.equal(e, f)
    out["odd"] = odd
    # coalesced
    xs = [_x((5,), r, torch.float32, 1), _x((2, 3), r, torch.float32, 2)]
    want = [x.clone() for x in xs]
    dist.all_reduce_coalesced(want, group=gloo)
    dist.all_reduce_coalesced(xs, async_op=True).wait()
    out["coalesced"] = all(torch.equal(a, b) for a, b in zip(xs, want))
    # broadcast (shared memory) from rank 1; gathers, reduce-scatter, all-to-all (gloo's), each against gloo's
    checks = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x, y = _x((7, 3), r, dtype), _x((7, 3), r, dtype)
        dist.broadcast(x, src=1)
        dist.broadcast(y, src=1, group=gloo)
        checks[f"broadcast {dtype}"] = torch.equal(x, y)
    mine, theirs = _delegated(r, n, None), _delegated(r, n, gloo)
    checks.update({k: all(torch.equal(a, b) for a, b in zip(mine[k], theirs[k])) for k in mine})
    out["checks"] = checks
    dist.barrier()
    # a subgroup on the fanfold backend takes shared memory too
    sub = dist.new_group(backend="fanfold")
    x = _x((9,), r, torch.float64)
    want = x.clone()
    dist.all_reduce(want, group=gloo)
    dist.all_reduce(x, group=sub)
    out["subgroup"] = (torch.equal(x, want), sub.transport is not None, dist.get_backend(sub))
    # an error in a shared-memory collective reaches wait(): lengths differ between the ranks
    bad = dist.new_group(backend="fanfold")
    dist.all_reduce(torch.ones(2), group=bad)
    work = dist.all_reduce(torch.ones(3 + r), group=bad, async_op=True)
    try:
        work.wait()
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - the test looks at what arrived
        out["error"] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return out


def test_collectives_match_gloo():
    out = fanfold.launch(_collectives, nprocs=2, timeout=240)
    for o in out:
        assert o["name"] == "cpu:fanfold"
        assert o["shm"], "the shared-memory transport was not used"
        assert o["mismatch"] == [], o["mismatch"]
        assert o["strided"] and o["coalesced"]
        assert all(o["odd"].values()), o["odd"]
        assert all(o["checks"].values()), o["checks"]
        assert o["subgroup"][:2] == (True, True)
        assert o["error"] is not None and "all_reduce" in o["error"] and "rank" in o["error"], o["error"]


def _stall():
    r, n, _ = _init()
    group = dist.new_group(backend="fanfold", timeout=timedelta(seconds=3))
    dist.all_reduce(torch.ones(4), group=group)  # both ranks: the transport exists
    message = None
    if r == 0:  # rank 1 never joins this one
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except Exception as exc:  # noqa: BLE001
            message = (str(exc), time.monotonic() - start)
    dist.barrier()
    dist.destroy_process_group()
    return message


def test_missing_rank_is_named_within_the_timeout():
    out = fanfold.launch(_stall, nprocs=2, timeout=120, env={"FANFOLD_STALL_TIMEOUT": ""})
    message, waited = out[0]
    assert "rank 1" in message, message
    assert waited < 30


def _train(kind):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    r, n, gloo = _init()
    results = {}
    for name, group in (("gloo", gloo), ("fanfold", None)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        if kind == "fsdp":
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard
            mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            wrapped, opt = model, torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            wrapped = TorchDDP(model, process_group=group)
            opt = (ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01, process_group=group)
                   if kind == "zero" else torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(3):
            x, y = _x((6, 8), r, torch.float32, 10 + step), _x((6, 4), r, torch.float32, 20 + step)
            opt.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        results[name] = [p.detach().clone() for p in params]
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("kind", ["ddp", "zero", "fsdp"])
def test_torch_training_matches_gloo(kind):
    for res in fanfold.launch(_train, kind, nprocs=2, timeout=240):
        diffs = [(a - b).abs().max().item() for a, b in zip(res["gloo"], res["fanfold"])]
        # the same sums in the same order: bitwise
        assert all(torch.equal(a, b) for a, b in zip(res["gloo"], res["fanfold"])), diffs


def _denied():
    """Peer reads denied (as under Yama ptrace_scope=1 without PR_SET_PTRACER): the fallback is announced once."""
    r, n, _ = _init()

    def refuse(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted (simulated)")
    calls = []
    real = shm_peer.allow_peers
    with mock.patch.object(shm_peer, "_copy", side_effect=refuse), \
            mock.patch.object(shm_peer, "allow_peers", side_effect=lambda *a: (calls.append(a[1:]), real(*a))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = torch.ones(8)
            dist.all_reduce(t)
    ok = torch.equal(t, torch.full((8,), float(n)))
    messages = [str(w.message) for w in caught if "slower path" in str(w.message)]
    supports = dist.group.WORLD.transport.peer_read
    dist.destroy_process_group()
    return ok, messages, calls, supports


def test_peer_read_denied_is_announced_and_falls_back():
    for r, (ok, messages, calls, supports) in enumerate(fanfold.launch(_denied, nprocs=2, timeout=120)):
        assert ok and not supports
        assert calls == [(r, 2)]  # every rank allowed its peers before the probe
        assert len(messages) == 1 and "process_vm_readv" in messages[0], messages


def test_allow_peers_names_the_peer():
    class Seg:
        def pid(self, r):
            return 4242 + r
    libc = mock.MagicMock()
    libc.prctl.return_value = 0
    with mock.patch.object(ctypes, "CDLL", return_value=libc):
        shm_peer.allow_peers(Seg(), 0, 2)
        shm_peer.allow_peers(Seg(), 1, 3)
    (a, b), (c, d) = [call.args[:2] for call in libc.prctl.call_args_list]
    assert (a, b.value) == (shm_peer.PR_SET_PTRACER, 4243)  # two ranks: exactly the peer
    assert (c, d.value) == (shm_peer.PR_SET_PTRACER, shm_peer.PR_SET_PTRACER_ANY)


def test_registered_at_import():
    assert "fanfold" in dist.Backend.backend_list
    fanfold.collectives.backend.register()  # idempotent
    assert dist.Backend.backend_list.count("fanfold") == 1


def _turned_off():
    r, n, gloo = _init()
    x = _x((1000,), r, torch.float32)
    want = x.clone()
    dist.all_reduce(want, group=gloo)
    dist.all_reduce(x)
    dist.barrier()
    used = dist.group.WORLD.transport is not None
    dist.destroy_process_group()
    return torch.equal(x, want), used


def test_turned_off_by_environment():
    for same, used in fanfold.launch(_turned_off, nprocs=2, timeout=120, env={"FANFOLD_TRANSPORT": "torch"}):
        assert same and not used


def _fanfold_ddp():
    """fanfold's DDP on the fanfold group runs on the group's own transport; torch's DDP over gloo is the oracle."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    r, n, gloo = _init()
    results = {}
    for name in ("torch-gloo", "fanfold-group"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        wrapped = (TorchDDP(model, process_group=gloo) if name == "torch-gloo"
                   else fanfold.DistributedDataParallel(model))  # on the default group: the fanfold backend's
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = _x((6, 8), r, torch.float32, 10 + step), _x((6, 4), r, torch.float32, 20 + step)
            opt.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
        results[name] = [p.detach().clone() for p in model.parameters()]
        if name == "fanfold-group":
            inner = getattr(wrapped.transport, "inner", wrapped.transport)
            results["same_transport"] = inner is dist.group.WORLD.transport and inner is not None
    dist.destroy_process_group()
    return results


def test_fanfold_ddp_uses_the_groups_transport():
    for res in fanfold.launch(_fanfold_ddp, nprocs=2, timeout=240):
        assert res["same_transport"]
        torch.testing.assert_close(res["fanfold-group"], res["torch-gloo"])
