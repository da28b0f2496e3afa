"""ZeRO stage 2's parameters laid flat per bucket and gathered in place after ``step()``, on 2 gloo ranks over the shm
transport and the torch one, against one process training on the whole batch with torch's Adam (20 steps, float64):
the parameters after training; the parameters read between ``step()`` and the next forward (raw reads, the model's
state_dict) and an eval forward under ``no_grad`` there, each against the oracle's values after the same step; a
model whose forward reads a child's weight without calling the child, and a transformer (MultiheadAttention reads its
``out_proj`` weight the same way).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_zero_training import STEPS

import fanfold
from _ddp_models import TinyLM, batch, loss_fn, mlp, shard
from fanfold.distributed import init_process_group

CAPS = dict(bucket_cap_mb=0.01, first_bucket_cap_mb=0.005)  # several buckets
ROWS = 12


class ReachIn(torch.nn.Module):
    """The MLP, then a head whose weight the parent reads itself: the head module is never called."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.body(x)
        return h + F.linear(torch.tanh(h), self.head.weight, self.head.bias)


def _build(kind):
    torch.manual_seed(0)
    return {"mlp": mlp, "lm": TinyLM, "reach": ReachIn}[kind]().double()


def _batch(kind, step):
    x, y = batch("lm" if kind == "lm" else "mlp", step, n=ROWS)
    return (x, y) if kind == "lm" else (x.double(), y.double())


def _eval_input(kind):
    return _batch(kind, 999)[0]


def _loss(kind, out, y):
    return loss_fn("lm" if kind == "lm" else "mlp", out, y)


def _snapshot(kind, model, reads):
    if reads == "params":
        return [p.detach().clone() for p in model.parameters()]
    if reads == "state_dict":
        return [v.clone() for v in model.state_dict().values()]
    if reads == "eval":
        model.eval()
        with torch.no_grad():
            out = model(_eval_input(kind)).clone()
        model.train()
        return [out]
    return []


def oracle(kind, reads):
    """One process, the whole batch, torch's Adam: the final parameters and what ``reads`` sees after each step."""
    model = _build(kind)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    seen = []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(kind, model(_batch(kind, step)[0]), _batch(kind, step)[1]).backward()
        opt.step()
        seen.append(_snapshot(kind, model, reads))
    return [p.detach().clone() for p in model.parameters()], seen


def _train(kind, transport, reads):
    model = _build(kind)
    ddp = fanfold.DistributedDataParallel(model, transport=transport, **CAPS)
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    r, n = dist.get_rank(), dist.get_world_size()
    ddp.shard_gradients(opt)
    seen = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(kind, step)
        _loss(kind, ddp(shard(x, r, n)), shard(y, r, n)).backward()
        opt.step()
        seen.append(_snapshot(kind, ddp if reads == "eval" else model, reads))
    return {"params": [p.detach().clone() for p in model.parameters()], "seen": seen,
            "buckets": len(ddp.reducer.buckets)}


PLAN = {"mlp/params": ("mlp", "shm", "params"), "mlp/state_dict": ("mlp", "shm", "state_dict"),
        "mlp/eval": ("mlp", "shm", "eval"), "lm/eval": ("lm", "shm", "eval"), "lm/params": ("lm", "shm", "params"),
        "reach": ("reach", "shm", None), "mlp/torch": ("mlp", "torch", "params")}


def _ranks():
    init_process_group(timeout=60)
    torch.set_num_threads(1)
    return {key: _train(*args) for key, args in PLAN.items()}


@pytest.fixture(scope="module")
def two_ranks():
    return fanfold.launch(_ranks, nprocs=2, timeout=300)


def _assert_close(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("key", list(PLAN))
def test_stage2_trains_and_reads_between_steps_as_single_process(two_ranks, key):
    kind, transport, reads = PLAN[key]
    want, want_seen = oracle(kind, reads)
    for res in two_ranks:
        assert res[key]["buckets"] > 1
        _assert_close(res[key]["params"], want)
        for got, expected in zip(res[key]["seen"], want_seen, strict=True):  # read between step() and forward
            _assert_close(got, expected)

