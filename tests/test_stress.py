"""Stress: 500 steps of 2-rank DDP with random per-rank batch sizes, no_sync windows and a join for uneven ends.

Passes when nothing hangs (every run is bounded by fanfold.launch's timeout and the stall inspector), a fingerprint
of the parameters (a hash of their bytes) is identical on both ranks every 50 steps and at the end, and the final
parameters equal those of the same 500 steps in a single process (the oracle), within float32 summation-order noise.
"""
import hashlib
import random
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fanfold
from fanfold.distributed import init_process_group

STEPS = 500
TAIL = 13  # rank 1 runs out of data this many steps before rank 0: join() shadows rank 0's collectives


def _fingerprint(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _schedule(seed):
    """Steps inside a no_sync window, the same on every rank (a shared seed); none in the uneven tail."""
    rng, skip, step = random.Random(seed), set(), 0
    while step < STEPS - TAIL - 5:
        if rng.random() < 0.1:
            length = rng.randint(1, 4)
            skip.update(range(step, step + length))
            step += length
        step += 1
    return skip


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1))


def _batch(data):
    x = torch.randn(int(torch.randint(1, 17, (1,), generator=data)), 8, generator=data)
    return x, x[:, :1].sin()


def _stress(seed, kwargs):
    init_process_group(timeout=60)
    rank = dist.get_rank()
    model = _model(rank)  # different initial weights: the constructor's broadcast must make them equal
    ddp = fanfold.DistributedDataParallel(model, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    accumulate = _schedule(seed)
    data = torch.Generator().manual_seed(seed * 10 + rank + 1)  # per-rank batches of random size
    fingerprints = {}
    with ddp.join():
        for step in range(STEPS - TAIL * rank):
            x, y = _batch(data)
            with ddp.no_sync() if step in accumulate else nullcontext():
                F.mse_loss(ddp(x), y).backward()
            if step not in accumulate:
                opt.step()
                opt.zero_grad()
            if step % 50 == 0:
                fingerprints[step] = _fingerprint(model)
    return fingerprints, _fingerprint(model), torch.cat([p.detach().flatten() for p in model.parameters()])


def _single_process(seed):
    """The same 500 steps in one process: rank r's loss divided by the world size, as DDP averages; a rank that
    has joined contributes nothing (join divides by the initial world size)."""
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    accumulate = _schedule(seed)
    data = [torch.Generator().manual_seed(seed * 10 + rank + 1) for rank in (0, 1)]
    for step in range(STEPS):
        for rank in (0, 1):
            if step < STEPS - TAIL * rank:
                x, y = _batch(data[rank])
                (F.mse_loss(model(x), y) / 2).backward()
        if step not in accumulate:
            opt.step()
            opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    {"transport": "torch"},
    {"transport": "torch", "bucket_cap_mb": 0.001, "gradient_as_bucket_view": True},
    {"transport": "shm", "find_unused_parameters": True},
], ids=["torch", "torch-small-buckets-views", "shm-find-unused"])
def test_500_steps_random_batches_no_sync_and_join(kwargs):
    seed = 1234
    (fp0, final0, p0), (fp1, final1, p1) = fanfold.launch(_stress, seed, kwargs, nprocs=2, timeout=180)
    shared = sorted(set(fp0) & set(fp1))
    assert len(shared) == 10 and len(_schedule(seed)) > 20  # checkpoints 0, 50, ..., 450; windows were exercised
    for step in shared:
        assert fp0[step] == fp1[step], f"parameters differ between ranks at step {step}"
    assert final0 == final1
    torch.testing.assert_close(p0, _single_process(seed), rtol=1e-5, atol=1e-6)
