"""torch's private ``_apply_optimizer_in_backward`` under fanfold's DDP on 2 gloo ranks: the optimizers step on the
averaged gradient, as torch's DDP makes them (its own hook needs an accelerator stream, so the oracle is one process
on the whole batch with a plain optimizer, in float64), ``.grad`` is None afterwards, ``no_sync()`` accumulates
without a step, an ignored parameter keeps its local step, and what cannot be combined with them is refused."""
import pytest
import torch
from torch import nn

import fanfold
from _ddp_models import batch, loss_fn, mlp, shard
from fanfold.distributed import init_process_group, rank, world_size

TINY = dict(bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)  # several buckets of this float64 model
OPTIMS = {"sgd": ("SGD", dict(lr=0.05, momentum=0.9)), "adam": ("Adam", dict(lr=0.01))}
STEPS = 3


def _model():
    return mlp().double()


def _data(step):
    return [t.double() for t in batch("mlp", step)]


def _apply(params, kind):
    from torch.distributed.optim import _apply_optimizer_in_backward

    name, kwargs = OPTIMS[kind]
    _apply_optimizer_in_backward(getattr(torch.optim, name), params, kwargs)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train(kind, as_view, before, micro=1):
    """STEPS steps, each of ``micro`` backward passes (all but the last under no_sync()); the final parameters and
    whether every .grad was None after each synchronised backward."""
    r, n = rank(), world_size()
    model = _model()
    if before:
        _apply(model.parameters(), kind)
    ddp = fanfold.DDP(model, gradient_as_bucket_view=as_view, **TINY)
    if not before:  # after construction, before the first forward: torch's DDP takes them over then
        _apply(model.parameters(), kind)
    none_after = True
    for step in range(STEPS):
        for k in range(micro):
            x, y = _data(step * micro + k)
            if k < micro - 1:
                with ddp.no_sync():
                    loss_fn("mlp", ddp(shard(x, r, n)), shard(y, r, n)).backward()
            else:
                loss_fn("mlp", ddp(shard(x, r, n)), shard(y, r, n)).backward()
        none_after = none_after and all(p.grad is None for p in model.parameters())
    return _params(model), none_after


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 6).double(), nn.Linear(6, 2).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _refused(make, act):
    """The message of the RuntimeError that ``act(ddp)`` raises for a DDP from ``make()``, else None."""
    ddp = make()
    try:
        act(ddp)
    except RuntimeError as exc:
        return str(exc)
    return None


def _runs():
    init_process_group(timeout=60)
    r = rank()
    out = {}
    for kind in OPTIMS:
        for as_view in (False, True):
            for before in (True, False):
                out[kind, as_view, before] = _train(kind, as_view, before)
    out["no_sync"] = _train("adam", False, True, micro=2)
    # an ignored parameter is left to its own hook: it steps on this rank's gradient, as with torch's DDP
    model = TwoLayers()
    fanfold.DDP._set_params_and_buffers_to_ignore_for_model(model, ["a.weight"])
    _apply(model.parameters(), "sgd")
    ddp = fanfold.DDP(model)
    g = torch.Generator().manual_seed(r)
    loss_fn("mlp", ddp(torch.randn(4, 6, generator=g, dtype=torch.float64)),
            torch.randn(4, 2, generator=g, dtype=torch.float64)).backward()
    out["ignored"] = _params(model)

    def with_optims(**kwargs):
        model = TwoLayers()
        _apply(model.parameters(), "sgd")
        return fanfold.DDP(model, **kwargs)

    x = torch.ones(2, 6, dtype=torch.float64)

    def hook_then_forward(ddp):
        ddp.register_comm_hook(None, fanfold.distributed.allreduce_hook)
        ddp(x)

    def forward_then_hook(ddp):
        ddp(x)
        ddp.register_comm_hook(None, fanfold.distributed.allreduce_hook)

    def join(ddp):
        ddp(x)
        with ddp.join():
            pass

    from torch.nn.parallel.distributed import _MixedPrecision

    out["refused"] = {
        "hook_then_forward": _refused(with_optims, hook_then_forward),
        "forward_then_hook": _refused(with_optims, forward_then_hook),
        "mixed_precision": _refused(lambda: with_optims(mixed_precision=_MixedPrecision(torch.float32)),
                                    lambda ddp: ddp(x)),
        "join": _refused(with_optims, join),
    }
    return out


def _oracle(kind, micro=1):
    """One process, the whole batch, the mean loss, a plain optimizer stepping after each (accumulated) backward."""
    name, kwargs = OPTIMS[kind]
    model = _model()
    opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(micro):
            x, y = _data(step * micro + k)
            loss_fn("mlp", model(x), y).backward()
        opt.step()
    return _params(model)


def _close(a, b):
    return all(torch.allclose(x, y, rtol=1e-10, atol=1e-12) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def ranks():
    return fanfold.launch(_runs, nprocs=2, timeout=240)


def test_optimizers_step_on_the_average(ranks):
    r0, r1 = ranks
    oracles = {kind: _oracle(kind) for kind in OPTIMS}
    start = _params(_model())
    for kind in OPTIMS:
        for as_view in (False, True):
            for before in (True, False):
                key = kind, as_view, before
                (p0, none0), (p1, none1) = r0[key], r1[key]
                assert not _close(p0, start), key  # the optimizers did step
                assert _close(p0, oracles[kind]) and _close(p1, oracles[kind]), key
                assert none0 and none1, key  # torch's DDP leaves .grad None


def test_no_sync_accumulates_then_steps_once(ranks):
    r0, r1 = ranks
    oracle = _oracle("adam", micro=2)
    assert _close(r0["no_sync"][0], oracle) and _close(r1["no_sync"][0], oracle)


def test_ignored_parameter_steps_on_its_own_gradient(ranks):
    (a0w, a0b, b0w, b0b), (a1w, a1b, b1w, b1b) = ranks[0]["ignored"], ranks[1]["ignored"]
    assert not torch.equal(a0w, a1w)
    assert torch.equal(a0b, a1b) and torch.equal(b0w, b1w) and torch.equal(b0b, b1b)


@pytest.mark.parametrize("case", ["hook_then_forward", "forward_then_hook", "mixed_precision", "join"])
def test_refused_combinations(ranks, case):
    for r, out in enumerate(ranks):
        message = out["refused"][case]
        assert message is not None, (case, r)
        assert f"rank {r}" in message and "_apply_optimizer_in_backward" in message and "a.weight" in message, message
