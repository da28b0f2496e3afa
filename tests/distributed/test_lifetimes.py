"""Memory fanfold hands out outlives whatever made it: gradients that view DDP's buckets after the wrapper is
collected, after the process group is destroyed, after a deepcopy's original is
gone; ZeRO's parameters and gradients after the optimizer and the wrapper are deleted (stage 2: with the parameters'
gather still in flight); a tensor reduced by a transport after that transport is closed, and no mapping kept by a closed
transport. Each case runs in two launched ranks against torch's own DDP over gloo doing the same
(same initial weights, same data); a rank that crashes (a read of unmapped memory: exit code -11) fails the launch.
"""
import copy
import gc
import io
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fanfold
from fanfold.collectives.shm.transport import ShmTransport
from fanfold.distributed import init_process_group

STEPS, GLOBAL = 3, 8


class Net(nn.Module):
    """a -> b, plus a side branch that rank 1 leaves out in the last step (``find_unused_parameters``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.side = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)

    def forward(self, x, side=True):
        h = torch.relu(self.a(x))
        return self.b(h) + self.side(h) if side else self.b(h)


def _loss(ddp, step, r, n, side=True):
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(GLOBAL, 16, generator=g), torch.randn(GLOBAL, 4, generator=g)
    per = GLOBAL // n
    return ((ddp(x[r * per:(r + 1) * per], side=side) - y[r * per:(r + 1) * per]) ** 2).mean()


def _wrap(impl, model, group=None, **kw):
    if impl == "torch":
        return nn.parallel.DistributedDataParallel(model, process_group=group, **kw)
    return fanfold.DDP(model, **({"transport": "shm"} if impl == "shm" else {}), **kw)


def _train(ddp, opt, unused):
    r, n = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        opt.zero_grad()
        _loss(ddp, step, r, n, side=not (unused and r == 1 and step == STEPS - 1)).backward()
        opt.step()
    opt.zero_grad()
    _loss(ddp, STEPS, r, n).backward()  # gradients left in the buckets for after the wrapper


def _snapshot(model):
    return {k: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for k, p in model.named_parameters()}


def _after(model, opt):
    """What a user does once the wrapper is gone: read .grad, step, zero in place, and a local backward that
    accumulates into the same .grad tensors."""
    out = {"grads": _snapshot(model)}
    opt.step()
    opt.zero_grad(set_to_none=False)
    _loss(model, STEPS + 1, dist.get_rank(), dist.get_world_size()).backward()
    out["end"] = _snapshot(model)
    return out


def _ddp_deleted(impl, unused, group=None):
    model = Net()
    ddp = _wrap(impl, model, group, gradient_as_bucket_view=True, find_unused_parameters=unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(ddp, opt, unused)
    del ddp
    gc.collect()
    return _after(model, opt)


def _zero_deleted(impl, stage, group=None, late=0.0):
    """ZeRO beside DDP, both deleted, then the model read. Stage 1 with gradient_as_bucket_view (parameters and
    gradients read); stage 2 right after a step() that returns with the parameters' gather in flight, which rank 1
    joins ``late`` seconds after rank 0 (parameters read)."""
    model = Net()
    ddp = _wrap(impl, model, group, gradient_as_bucket_view=stage == 1)
    if impl == "torch":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        if stage == 2:
            ddp.shard_gradients(opt)
    _train(ddp, opt, False)
    if stage == 2:
        time.sleep(late if dist.get_rank() == 1 else 0.0)
        opt.step()
    del opt, ddp
    gc.collect()
    return {k: v if stage == 1 else v[0] for k, v in _snapshot(model).items()}


def _copies(impl):
    """Train, then a deepcopy and a torch.save/torch.load copy of the wrapper; the original deleted, each copy
    trained a step further on its own."""
    model = Net()
    ddp = _wrap(impl, model, gradient_as_bucket_view=True)
    _train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), False)
    buf = io.BytesIO()
    torch.save(ddp, buf)
    twin = copy.deepcopy(ddp)
    del ddp, model
    gc.collect()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out = {}
    for name, copied in (("deepcopy", twin), ("pickled", loaded)):
        opt = torch.optim.SGD(copied.parameters(), lr=0.1)
        opt.zero_grad()
        _loss(copied, STEPS + 1, dist.get_rank(), dist.get_world_size()).backward()
        out[name, "grads"] = _snapshot(copied.module)
        opt.step()
        out[name] = _snapshot(copied.module)
    return out


def _region(impl):
    """A tensor (and a view of it) summed over the ranks, then its transport closed and dropped."""
    r = dist.get_rank()
    values = torch.arange(100_000, dtype=torch.float32) * (r + 1)
    if impl == "torch":
        x = values.clone()
        dist.all_reduce(x)
        part = x[10:20]
    else:
        t = ShmTransport()
        x = torch.zeros(values.numel())
        x.copy_(values)
        t.all_reduce(x).wait()
        part = x[10:20]
        t.close()
        mapped = _mappings()  # none: the ring is unmapped by close()
        del t
        gc.collect()
    part.add_(1)
    out = {"sum": x.clone(), "part": part.clone()}
    if impl != "torch":
        del x
        out["mapped"] = (mapped, _mappings(), part.sum().item())
        del part
        ShmTransport().close()  # never lent out: unmapped by close(), while the object may live on
        out["mapped"] += (_mappings(),)
    return out


def _mappings():
    with open("/proc/self/maps") as f:
        return sum("/fanfold-" in line for line in f)


def _worker(case):
    torch.set_num_threads(1)
    init_process_group(timeout=60)
    kind, *arg = case
    run = {"ddp": _ddp_deleted, "zero": _zero_deleted, "copies": _copies, "region": _region}[kind]
    return {impl: run(impl, *arg) for impl in ("torch", "shm")}  # the oracle first


def _destroyed(unused):
    """fanfold's DDP on the ``fanfold`` backend (the group's own shm transport); the group destroyed, then .grad
    read. The oracle, torch's DDP, runs on a gloo group beside it."""
    torch.set_num_threads(1)
    init_process_group("fanfold", timeout=60)
    gloo = dist.new_group(backend="gloo")
    out = {"torch": _ddp_deleted("torch", unused, gloo)}
    model = Net()
    ddp = _wrap("fanfold", model, gradient_as_bucket_view=True, find_unused_parameters=unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(ddp, opt, unused)
    r, n = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    gc.collect()
    out["shm"] = {"grads": _snapshot(model)}
    opt.step()
    opt.zero_grad(set_to_none=False)
    _loss(model, STEPS + 1, r, n).backward()  # the wrapper's hooks are still on: nothing to reduce, no group needed
    out["shm"]["end"] = _snapshot(model)
    del ddp
    gc.collect()
    return out


def _close(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _check(results):
    for r, res in enumerate(results):
        if "mapped" in res["shm"]:
            assert res["shm"].pop("mapped") == (0, 0, res["torch"]["part"].sum().item(), 0), r
        assert _close(res["shm"], res["torch"]), f"rank {r}: fanfold differs from torch's DDP"


@pytest.mark.parametrize("case", [("ddp", False), ("ddp", True), ("zero", 1), ("copies",), ("region",)],
                         ids=["as_view", "as_view-unused", "zero1", "copies", "region"])
def test_memory_outlives_its_owner(case):
    _check(fanfold.launch(_worker, case, nprocs=2, timeout=120))


@pytest.mark.parametrize("unused", [False, True], ids=["as_view", "as_view-unused"])
def test_grads_outlive_the_process_group(unused):
    _check(fanfold.launch(_destroyed, unused, nprocs=2, timeout=120))


def _zero2_gather_in_flight():
    """ZeRO stage 2 on the ``fanfold`` backend, whose transport outlives the wrapper: the optimizer and the wrapper
    deleted while the parameters' gather is in flight, then the parameters read. The oracle runs on a gloo group."""
    torch.set_num_threads(1)
    init_process_group("fanfold", timeout=60)
    gloo = dist.new_group(backend="gloo")
    return {"torch": _zero_deleted("torch", 2, gloo), "shm": _zero_deleted("fanfold", 2, late=1.0)}


def test_zero2_params_after_the_optimizer_is_deleted_mid_gather():
    _check(fanfold.launch(_zero2_gather_in_flight, nprocs=2, timeout=120))
