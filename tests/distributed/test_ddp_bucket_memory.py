"""The memory DDP's buckets take: none where each gradient is reduced where it is (the built-in hook, large gradients,
no gradient_as_bucket_view), the whole buckets where a user's comm hook needs them; the gradients equal torch's DDP's
(gloo) in the same two launched ranks either way."""
import torch
from torch import nn

import fanfold
from _conformance import close, grads, shard, wrap
from fanfold.distributed import allreduce_hook, init_process_group, rank, world_size

GLOBAL, WIDTH = 8, 160  # gradients of 35 KiB on average: above the size reduced through a flat bucket


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))


def _bucket_bytes(ddp) -> int:
    return sum(f.untyped_storage().nbytes() for f in ddp.reducer.flats if f.device.type != "meta")


def _users_hook(state, bucket):  # not one of fanfold's built-in hooks: it gets a GradBucket of the flat bucket
    return allreduce_hook(state, bucket)


def _run(impl: str, hook: bool, r: int, n: int) -> dict:
    model = _model()
    ddp = wrap(impl, model)
    if hook:
        ddp.register_comm_hook(None, _users_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"grads": []}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL, WIDTH, generator=g), torch.randn(GLOBAL, 4, generator=g)
        opt.zero_grad(set_to_none=True)
        ((ddp(shard(x, r, n)) - shard(y, r, n)) ** 2).mean().backward()
        out["grads"].append(grads(model))
        opt.step()
    out["bytes"] = None if impl == "torch" else _bucket_bytes(ddp)
    return out


def _worker():
    init_process_group(timeout=60)
    r, n = rank(), world_size()
    return {(impl, hook): _run(impl, hook, r, n) for impl in ("torch", "fanfold/shm", "fanfold/torch")
            for hook in (False, True) if not (impl == "torch" and hook)}


def test_buckets_take_memory_only_where_a_hook_needs_them():
    gradient_bytes = sum(p.numel() * p.element_size() for p in _model().parameters())
    for res in fanfold.launch(_worker, nprocs=2, timeout=120):
        theirs = res["torch", False]["grads"]
        for impl in ("fanfold/shm", "fanfold/torch"):
            for hook in (False, True):
                ours = res[impl, hook]
                assert all(close(a, b) for a, b in zip(ours["grads"], theirs)), (impl, hook)
                assert ours["bytes"] == (gradient_bytes if hook else 0), (impl, hook, ours["bytes"])
