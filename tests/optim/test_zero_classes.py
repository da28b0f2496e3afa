"""ZeroRedundancyOptimizer over torch's elementwise optimizers (their options, a subclass, ``fused``), bitwise against
the plain torch optimizer over the whole parameters (one process), with two parameter groups, an LR scheduler and the
state_dict both ways. One test runs 2 gloo ranks at stage 2 against a plain torch optimizer fed the same averaged
gradients, then resumes the 2-rank checkpoint in one process.
"""
import copy

import pytest
import torch
import torch.distributed as dist

import fanfold
from fanfold.distributed import init_process_group

F32 = 131072  # float32 elements in 512 KiB


def _params():
    """Float32 parameters of several sizes, small ones, a 0-d one, and a float64 one."""
    g = torch.Generator().manual_seed(0)
    shapes = [((3, F32 // 2 + 5), torch.float32), ((7,), torch.float32), ((F32 + 3,), torch.float32),
              ((11, 13), torch.float32), ((), torch.float32), ((F32 // 2 + 9,), torch.float64)]
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=d)) for s, d in shapes]


def _groups(params, cls):
    second = {"lr": 0.003}
    if "weight_decay" in cls([torch.zeros(1)]).defaults:
        second["weight_decay"] = 0.01
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def _run(opt, sched, params, steps):
    for step in steps:
        for p, grad in zip(params, _grads(params, step)):
            p.grad = grad
        opt.step()
        sched.step()


def _assert_same_state(mine, theirs):
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        assert mine["state"][i].keys() == s.keys(), i
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(mine["state"][i][k], v), (i, k)
            else:
                assert mine["state"][i][k] == v, (i, k)


CASES = [
    (torch.optim.SGD, dict(lr=0.01)), (torch.optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True, maximize=True)),
    (torch.optim.SGD, dict(lr=0.01, momentum=0.9, dampening=0.1, foreach=True)),
    (torch.optim.SGD, dict(lr=0.01, momentum=0.9, differentiable=True)),
    (torch.optim.Adam, dict(lr=0.01)), (torch.optim.Adam, dict(lr=0.01, amsgrad=True, foreach=True)),
    (torch.optim.Adam, dict(lr=0.01, maximize=True, differentiable=True)),
    (torch.optim.Adam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1, foreach=True)),
    (torch.optim.AdamW, dict(lr=0.01)), (torch.optim.AdamW, dict(lr=0.01, amsgrad=True, foreach=True)),
    (torch.optim.Adagrad, dict(lr=0.01, lr_decay=0.01, initial_accumulator_value=0.1)),
    (torch.optim.Adagrad, dict(lr=0.01, foreach=True, maximize=True)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)), (torch.optim.RMSprop, dict(foreach=True)),
    (torch.optim.Adamax, dict(lr=0.01)), (torch.optim.Adamax, dict(lr=0.01, foreach=True)),
    (torch.optim.NAdam, dict(lr=0.01)), (torch.optim.NAdam, dict(lr=0.01, decoupled_weight_decay=True, foreach=True)),
    (torch.optim.RAdam, dict(lr=0.01)), (torch.optim.RAdam, dict(lr=0.01, decoupled_weight_decay=True, foreach=True)),
    (torch.optim.Adadelta, dict()), (torch.optim.Adadelta, dict(foreach=True, maximize=True)),
    (torch.optim.Rprop, dict(lr=0.01)), (torch.optim.Rprop, dict(lr=0.01, foreach=True)),
    (torch.optim.ASGD, dict(lr=0.01, t0=2)), (torch.optim.ASGD, dict(lr=0.01, t0=2, foreach=True)),
]


@pytest.mark.parametrize("cls,kw", CASES, ids=[f"{c.__name__}-{'-'.join(kw) or 'default'}" for c, kw in CASES])
def test_steps_bitwise_like_torch(cls, kw):
    mine, theirs = _params(), [p.detach().clone() for p in _params()]  # the oracle's: plain tensors, .grad by hand
    zero = fanfold.ZeroRedundancyOptimizer(_groups(mine, cls), cls, **kw)
    plain = cls(_groups(theirs, cls), **kw)
    assert len(zero.optim.param_groups) == len(zero.param_groups)  # one inner group per group (docs/zero.md)
    zsched, psched = (torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (zero, plain))
    _run(zero, zsched, mine, range(4))
    _run(plain, psched, theirs, range(4))
    assert zero.param_groups[1]["lr"] == plain.param_groups[1]["lr"] == 0.003 * 0.25
    for p, q in zip(mine, theirs):
        assert torch.equal(p, q)
    zero.consolidate_state_dict()
    _assert_same_state(zero.state_dict(), plain.state_dict())
    # Both ways: ZeRO's state into a plain optimizer, the plain one's into a fresh ZeRO; all go on alike. (Deep
    # copies, as through a file: like torch's, the state dicts hold the live `step` tensors.)
    copies = [p.detach().clone() for p in theirs]
    plain2 = cls(_groups(copies, cls), **kw)
    plain2.load_state_dict(copy.deepcopy(zero.state_dict()))
    zero2_params = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    zero2 = fanfold.ZeroRedundancyOptimizer(_groups(zero2_params, cls), cls, **kw)
    zero2.load_state_dict(copy.deepcopy(plain.state_dict()))
    for opt, params in ((zero, mine), (plain, theirs), (plain2, copies), (zero2, zero2_params)):
        for step in range(4, 6):
            for p, grad in zip(params, _grads(params, step)):
                p.grad = grad
            opt.step()
    for p, q, p2, q2 in zip(mine, theirs, zero2_params, copies):
        # Reloaded optimizers against each other: torch's load_state_dict casts some state (NAdam's float32
        # mu_product) to a float64 parameter's dtype, so a reloaded plain optimizer may differ from the original.
        assert torch.equal(p, q) and torch.equal(p2, q2)


class MyAdam(torch.optim.Adam):
    """A subclass, taken at its word."""


@pytest.mark.parametrize("cls,kw", [(MyAdam, dict(lr=0.01)), (torch.optim.Adam, dict(lr=0.01, fused=True)),
                                    (torch.optim.SGD, dict(lr=0.01, momentum=0.9, fused=True))])
def test_subclasses_and_fused_step_like_torch(cls, kw):
    mine, theirs = _params(), [p.detach().clone() for p in _params()]
    zero = fanfold.ZeroRedundancyOptimizer(_groups(mine, cls), cls, **kw)
    plain = cls(_groups(theirs, cls), **kw)
    assert [len(g["params"]) for g in zero.optim.param_groups] == [2, 4]  # one view per parameter
    for opt, params in ((zero, mine), (plain, theirs)):
        for step in range(3):
            for p, grad in zip(params, _grads(params, step)):
                p.grad = grad
            opt.step()
    for p, q in zip(mine, theirs):
        assert torch.equal(p, q)


# ---- 2 ranks, stage 2 ---------------------------------------------------------------------------------------------
KW, STEPS2, SAVE2 = dict(lr=0.01, amsgrad=True), 5, 3


def _net():
    torch.manual_seed(0)  # float32, 2 x 400,000 weights: several buckets of 2 MB
    return torch.nn.Sequential(torch.nn.Linear(200, 2000), torch.nn.Tanh(), torch.nn.Linear(2000, 200))


def _half(step, rank):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 200, generator=g), torch.randn(8, 200, generator=g)
    return x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]


def _adam_groups(model):
    return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.003, "weight_decay": 0.01}]


def _stage2(path):
    init_process_group(timeout=60)
    model = _net()
    ddp = fanfold.DistributedDataParallel(model, transport="torch", bucket_cap_mb=2, first_bucket_cap_mb=2)
    opt = fanfold.ZeroRedundancyOptimizer(_adam_groups(model), torch.optim.Adam, **KW)
    ddp.shard_gradients(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(STEPS2):
        if step == SAVE2:
            fanfold.save(path, {"model": ddp, "optimizer": opt, "sched": sched})
        opt.zero_grad()
        ((ddp(_half(step, dist.get_rank())[0]) - _half(step, dist.get_rank())[1]) ** 2).mean().backward()
        opt.step()
        sched.step()
    opt.consolidate_state_dict(to=0)
    return {"params": [p.detach().clone() for p in model.parameters()], "groups": len(opt.optim.param_groups),
            "state": opt.state_dict() if dist.get_rank() == 0 else None}


def _oracle_step(model, opt, sched, step):
    """The plain optimizer, fed the gradient DDP averages: each rank's half-batch gradient, summed, halved (both
    exact in any order for two ranks)."""
    halves = []
    for r in range(2):
        x, y = _half(step, r)
        halves.append(torch.autograd.grad(((model(x) - y) ** 2).mean(), list(model.parameters())))
    for p, a, b in zip(model.parameters(), *halves):
        p.grad = (a + b) / 2
    opt.step()
    sched.step()


def test_two_ranks_stage2_bitwise_like_torch_and_resumes_in_one_process(tmp_path):
    path = str(tmp_path / "zero_stage2.pt")
    ranks = fanfold.launch(_stage2, path, nprocs=2, timeout=120)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: the same matrix products, bit for bit
    try:
        model = _net()
        plain = torch.optim.Adam(_adam_groups(model), **KW)
        sched = torch.optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
        for step in range(STEPS2):
            _oracle_step(model, plain, sched, step)
        # The 2-rank checkpoint, resumed by ZeRO in one process (other slices), goes on alike.
        again = _net()
        zero = fanfold.ZeroRedundancyOptimizer(_adam_groups(again), torch.optim.Adam, **KW)
        zsched = torch.optim.lr_scheduler.StepLR(zero, step_size=2, gamma=0.5)
        fanfold.load(path, {"model": again, "optimizer": zero, "sched": zsched}, rng=False)
        for step in range(SAVE2, STEPS2):
            _oracle_step(again, zero, zsched, step)
    finally:
        torch.set_num_threads(threads)
    for res in ranks:
        assert res["groups"] == 2  # one inner group per group
        for p, q in zip(res["params"], model.parameters()):
            assert torch.equal(p, q)
    for p, q in zip(again.parameters(), model.parameters()):
        assert torch.equal(p, q)
    _assert_same_state(ranks[0]["state"], plain.state_dict())
    loaded = torch.optim.Adam(_adam_groups(copy.deepcopy(model)), **KW)
    loaded.load_state_dict(ranks[0]["state"])  # the consolidated format loads into the plain optimizer
