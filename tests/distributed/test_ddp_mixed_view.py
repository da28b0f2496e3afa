"""``mixed_precision`` with ``gradient_as_bucket_view=True`` against one process, as docs/ddp-compat.md lists it:
torch's own DDP cannot run mixed precision on the CPU (with its CUDA events made no-ops its gradients are garbage),
so it is no oracle here.

Two gloo ranks, fanfold's DDP on shared memory and on the torch transport, with and without bucket views, bfloat16
compute reduced in float32 or in bfloat16; three steps of SGD with momentum, the second accumulating two micro-steps
(the first under ``no_sync()``). The oracle, in the test's own process: each rank's shard run on a copy of the
float32 masters cast to bfloat16 (parameters and inputs only, as torch's ``_MixedPrecision`` without
``buffer_dtype``), the gradients accumulated there in bfloat16, cast to the reduction dtype, averaged over the two
ranks and cast back to float32 for the optimizer. At world size 2 every step is the same to the bit: a sum of two
is exact in its order and a division by two is exact.
"""
import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

import fanfold
from fanfold.distributed import init_process_group, rank, world_size

WORLD, STEPS, MICRO = 2, 3, (1, 2, 1)  # micro-steps per step: the second accumulates under no_sync()
LOW = torch.bfloat16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int, micro: int, r: int):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + r)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _snapshot(model: nn.Module, what: str) -> list[torch.Tensor]:
    return [(p.grad if what == "grad" else p).detach().clone() for p in model.parameters()]


def _train(transport, as_view: bool, reduce: torch.dtype | None) -> dict:
    r = rank()
    model = _model()
    ddp = fanfold.DDP(model, transport=transport, gradient_as_bucket_view=as_view, bucket_cap_mb=0.0005,
                      mixed_precision=_MixedPrecision(param_dtype=LOW, reduce_dtype=reduce))
    opt = _optimizer(model)
    out = {"grads": [], "params": [], "dtypes": set()}
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO[step]):
            x, y = _batch(step, micro, r)
            if micro < MICRO[step] - 1:
                with ddp.no_sync():
                    _loss(ddp(x), y).backward()
            else:
                _loss(ddp(x), y).backward()
        out["grads"].append(_snapshot(model, "grad"))
        out["dtypes"] |= {p.grad.dtype for p in model.parameters()} | {p.dtype for p in model.parameters()}
        opt.step()
        out["params"].append(_snapshot(model, "param"))
    return out


CASES = [(transport, as_view, reduce) for transport in (None, "torch") for as_view in (False, True)
         for reduce in (torch.float32, None)]


def _ranks() -> dict:
    torch.set_num_threads(1)
    init_process_group("gloo", timeout=60)
    assert world_size() == WORLD
    return {case: _train(*case) for case in CASES}


def _oracle(reduce: torch.dtype | None) -> dict:
    """One process: the replicas of the two ranks, the average in the reduction dtype, SGD on the masters."""
    master = _model()
    opt = _optimizer(master)
    out = {"grads": [], "params": []}
    for step in range(STEPS):
        opt.zero_grad()
        grads = []
        for r in range(WORLD):
            replica = copy.deepcopy(master)
            for p in replica.parameters():
                p.data = p.data.to(LOW)
            for micro in range(MICRO[step]):
                x, y = _batch(step, micro, r)
                _loss(replica(x.to(LOW)), y).backward()  # accumulated in bfloat16, as the ranks' .grad
            grads.append([p.grad.to(reduce or LOW) for p in replica.parameters()])
        for p, *per_rank in zip(master.parameters(), *grads):
            p.grad = (sum(per_rank) / WORLD).to(p.dtype)
        out["grads"].append(_snapshot(master, "grad"))
        opt.step()
        out["params"].append(_snapshot(master, "param"))
    return out


@pytest.fixture(scope="module")
def ranks():
    return fanfold.launch(_ranks, nprocs=WORLD, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0] or 'shm'}-view={c[1]}-reduce={c[2] or 'bf16'}")
def test_mixed_precision_with_bucket_views_equals_one_process(ranks, case):
    want = _oracle(case[2])
    for r, got in enumerate(ranks):
        run = got[case]
        assert run["dtypes"] == {torch.float32}, (r, run["dtypes"])  # float32 masters and .grad for the optimizer
        for what in ("grads", "params"):
            for step, (a, b) in enumerate(zip(run[what], want[what])):
                bad = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
                assert not bad, (f"rank {r}, {what} at step {step}: parameters {bad} differ by up to "
                                 f"{max((a[i] - b[i]).abs().max().item() for i in bad)}")
