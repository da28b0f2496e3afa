"""Uneven inputs under ``join()``, 2 ranks (3 and 5 batches), against torch's DDP over gloo in the same processes:

- torch's own DDP on the ``fanfold`` backend, ``join(divide_by_initial_world_size=False)`` and ``join()`` with
  ``find_unused_parameters=True`` (a branch some steps skip): the parameters after every step are bitwise those of
  torch's DDP on gloo (float64);
- fanfold's DDP with its comm hooks (allreduce, fp16, bf16) under ``join(divide_by_initial_world_size=False)``:
  every step's parameters are bitwise those of torch's DDP with torch's hooks (``default_hooks``) on gloo, which
  divide by the group's size whoever has joined (float32).
Every run is bounded by ``fanfold.launch``'s timeout: a hang fails the test."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fanfold
from fanfold.distributed import allreduce_hook, bf16_compress_hook, fp16_compress_hook

COUNTS = (3, 5)  # batches per rank: rank 0 joins two steps early


class Branchy(nn.Module):
    """Its second branch is used on even steps only (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, use_b=True):
        h = self.a(x)
        return self.head(torch.tanh(h + self.b(x) if use_b else h))


def _batch(r, step, dtype):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + r), dtype=dtype)


def _train(wrap, dtype, join_kwargs, branchy=False):
    """Every step's parameters on this rank, training ``wrap(model)`` for this rank's count of batches."""
    r = dist.get_rank()
    torch.manual_seed(0)
    model = Branchy().to(dtype)
    ddp = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = []
    with ddp.join(**join_kwargs):
        for step in range(COUNTS[r]):
            opt.zero_grad()
            out = ddp(_batch(r, step, dtype), use_b=step % 2 == 0) if branchy else ddp(_batch(r, step, dtype))
            out.pow(2).mean().backward()
            opt.step()
            steps.append([p.detach().clone() for p in model.parameters()])
    steps.append([p.detach().clone() for p in model.parameters()])  # after join's final broadcast
    return steps


def _torch_ddp_on_fanfold():
    dist.init_process_group("fanfold", timeout=timedelta(seconds=30))
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, join_kwargs, unused in (("active", {"divide_by_initial_world_size": False}, False),
                                      ("unused", {}, True)):
        for label, group in (("gloo", gloo), ("fanfold", dist.group.WORLD)):
            def wrap(model, group=group, unused=unused):
                return nn.parallel.DistributedDataParallel(model, process_group=group, find_unused_parameters=unused)
            out[name, label] = _train(wrap, torch.float64, join_kwargs, branchy=unused)
    out["shm"] = dist.group.WORLD.transport is not None
    dist.destroy_process_group()
    return out


def test_torch_ddp_on_fanfold_backend_under_join_is_gloos():
    out = fanfold.launch(_torch_ddp_on_fanfold, nprocs=2, timeout=120)
    for r, o in enumerate(out):
        assert o["shm"]
        for name in ("active", "unused"):
            got, want = o[name, "fanfold"], o[name, "gloo"]
            assert len(got) == len(want) == COUNTS[r] + 1
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True)), (name, r, step)


def _torchs_bf16(group, bucket):
    # torch refuses a hook named bf16_compress_hook without CUDA and NCCL (it checks the name); the same function
    return default_hooks.bf16_compress_hook(group, bucket)


HOOKS = {"allreduce": (allreduce_hook, default_hooks.allreduce_hook),
         "fp16": (fp16_compress_hook, default_hooks.fp16_compress_hook),
         "bf16": (bf16_compress_hook, _torchs_bf16)}


def _hooks_under_join():
    dist.init_process_group("fanfold", timeout=timedelta(seconds=30))
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, (ours, torchs) in HOOKS.items():
        def torch_ddp(model, torchs=torchs):
            ddp = nn.parallel.DistributedDataParallel(model, process_group=gloo)
            ddp.register_comm_hook(gloo, torchs)
            return ddp

        def fanfold_ddp(model, ours=ours):
            ddp = fanfold.DDP(model)  # the default group: fanfold's backend, its shared memory
            ddp.register_comm_hook(None, ours)
            return ddp
        join_kwargs = {"divide_by_initial_world_size": False}
        out[name] = (_train(fanfold_ddp, torch.float32, join_kwargs), _train(torch_ddp, torch.float32, join_kwargs))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def hooks_under_join():
    return fanfold.launch(_hooks_under_join, nprocs=2, timeout=120)


@pytest.mark.parametrize("name", list(HOOKS))
def test_fanfold_hooks_divide_as_torchs_under_join(hooks_under_join, name):
    for r, o in enumerate(hooks_under_join):
        got, want = o[name]
        assert len(got) == len(want) == COUNTS[r] + 1
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            # bitwise: two ranks' sums round once on both backends, and halving is exact
            assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True)), (name, r, step)



def _delayed_under_join():
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))

    def wrap(model):
        return fanfold.DDP(model, delay_all_reduce_named_params=list(model.a.named_parameters(prefix="a")),
                           param_to_hook_all_reduce=model.head.weight)
    out = _train(wrap, torch.float32, {"divide_by_initial_world_size": False})
    dist.destroy_process_group()
    return out


def _delayed_oracle(delayed_divisor):
    """One process: each step, every active rank's gradient; the delayed parameters (``a``) summed and divided by
    ``delayed_divisor(active)``, the others by the active ranks (divide_by_initial_world_size=False)."""
    torch.manual_seed(0)
    master = Branchy()
    opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
    steps = {r: [] for r in range(2)}
    for step in range(max(COUNTS)):
        active = [r for r in range(2) if step < COUNTS[r]]
        grads = []
        for r in active:
            master.zero_grad()
            master(_batch(r, step, torch.float32)).pow(2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in master.named_parameters()})
        for n, p in master.named_parameters():
            p.grad = sum(g[n] for g in grads) / (delayed_divisor(active) if n.startswith("a.") else len(active))
        opt.step()
        for r in active:
            steps[r].append([p.detach().clone() for p in master.parameters()])
    return {r: steps[r] + [[p.detach().clone() for p in master.parameters()]] for r in steps}


def test_delayed_parameters_divide_by_the_world_size_under_join_as_torchs():
    """torch's delayed all-reduce (``DistributedDataParallel._delayed_all_reduce``) divides by the group's size
    whoever has joined; the buckets follow divide_by_initial_world_size. torch's own DDP cannot be the oracle
    here: with a rank joined its join hook issues no delayed all-reduce, and gloo aborts the process ("Is there a
    distributed collective mismatch"), so the oracle is one process with torch's divisors."""
    want = _delayed_oracle(lambda active: 2)
    other = _delayed_oracle(len)  # the divisor fanfold used before: tells the two apart
    for r, got in enumerate(fanfold.launch(_delayed_under_join, nprocs=2, timeout=120)):
        assert len(got) == len(want[r]) == COUNTS[r] + 1
        for step, (g, w) in enumerate(zip(got, want[r], strict=True)):
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g, w, strict=True)), (r, step)
        assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[-1], other[r][-1], strict=True))
