"""Many small parameters (one bucket of LayerNorm-sized gradients): fanfold's flat bucket
reduction against torch's own DDP over gloo, in the same two launched ranks on the same data -- plain steps,
set_to_none=False, no_sync accumulation, rank-dependent unused parameters, gradient_as_bucket_view, several buckets
-- and a buffer registered after wrapping, which neither DDP syncs."""
import torch
from torch import nn

import fanfold
from _conformance import close, grads, shard, wrap
from fanfold.distributed import init_process_group, rank, world_size

BLOCKS, WIDTH, GLOBAL = 12, 4, 8
FANFOLD = ("fanfold/torch", "fanfold/shm")
# case -> DDP keywords
CASES = {
    "plain": {},
    "keep_grads": {},  # zero_grad(set_to_none=False): autograd accumulates into the existing .grad
    "no_sync": {},
    "unused": {"find_unused_parameters": True},
    "as_view": {"gradient_as_bucket_view": True},
    "buckets": {"bucket_cap_mb": 0.0005},  # several buckets: no deferral, each bucket flat
}


class Blocks(nn.Module):
    """BLOCKS x (Linear(WIDTH, WIDTH), LayerNorm(WIDTH)); ``skip`` leaves block 1 out (its parameters unused)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(BLOCKS))

    def forward(self, x, skip=False):
        for k, block in enumerate(self.blocks):
            if not (skip and k == 1):
                x = block(x)
        return x


def _data(step: int):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(GLOBAL, WIDTH, generator=g), torch.randn(GLOBAL, WIDTH, generator=g)


def _loss(ddp, step, r, n, skip=False):
    x, y = _data(step)
    return ((ddp(shard(x, r, n), skip=skip) - shard(y, r, n)) ** 2).mean()


def _run(case: str, impl: str, r: int, n: int) -> dict:
    """Three steps of SGD(lr=0.1); the gradients after each backward, the parameters at the end, and (fanfold) how
    many buckets there were."""
    model = Blocks()
    ddp = wrap(impl, model, **CASES[case])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"grads": []}
    for step in range(3):
        opt.zero_grad(set_to_none=case != "keep_grads")
        if case == "no_sync":
            with ddp.no_sync():
                _loss(ddp, 10 + step, r, n).backward()
        loss = _loss(ddp, step, r, n, skip=case == "unused" and (r == 1 or step == 2))
        loss.backward()
        out["grads"].append(grads(model))
        opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["buckets"] = None if impl == "torch" else len(ddp.reducer.buckets)
    return out


def _late_buffer(impl: str, r: int) -> float:
    model = Blocks()
    ddp = wrap(impl, model)
    model.blocks[0].register_buffer("late", torch.full((1,), float(r)))  # after wrapping: torch never syncs it
    _loss(ddp, 0, r, world_size()).backward()
    return model.blocks[0].late.item()


def _worker():
    init_process_group(timeout=60)
    r, n = rank(), world_size()
    out = {(case, impl): _run(case, impl, r, n) for case in CASES for impl in ("torch",) + FANFOLD}
    out["late"] = {impl: _late_buffer(impl, r) for impl in ("torch",) + FANFOLD}
    return out


def test_small_parameters_match_torch_ddp():
    results = fanfold.launch(_worker, nprocs=2, timeout=280)
    for r, res in enumerate(results):
        for case in CASES:
            theirs = res[case, "torch"]
            for impl in FANFOLD:
                ours = res[case, impl]
                for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
                    assert close(a, b), (r, case, impl, step)
                assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours["params"], theirs["params"]))
                assert (ours["buckets"] == 1) == (case != "buckets"), (case, impl, ours["buckets"])
        # block 1 unused on rank 1 in every step, and on both ranks in the last: averaged, then left None
        unused = res["unused", "fanfold/shm"]["grads"]
        assert unused[0]["blocks.1.0.weight"] is not None and unused[2]["blocks.1.0.weight"] is None
        assert res["late"] == {impl: float(r) for impl in ("torch",) + FANFOLD}, res["late"]
    for case in CASES:  # both ranks end with the same model
        for impl in FANFOLD:
            assert all(torch.equal(a, b) for a, b in zip(results[0][case, impl]["params"],
                                                         results[1][case, impl]["params"])), (case, impl)
