"""ZeroRedundancyOptimizer in one process (no process group: one rank) against the plain torch optimizer: the flat
layout, state_dict in torch's format both ways, add_param_group, LR changes, and its errors."""
import copy
import math

import pytest
import torch

import fanfold
from fanfold.optim.layout import pieces_of, plan_spaces


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    ((model(torch.randn(4, 5, generator=g, dtype=torch.float64)) - 1) ** 2).mean().backward()
    opt.step()


@pytest.mark.parametrize("world", [1, 2, 3, 5, 200])
def test_layout_equal_contiguous_slices_cover_every_element_once(world):
    params = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(2, dtype=torch.float64), torch.zeros(7), torch.zeros(())]
    spaces = plan_spaces(params, world)
    assert [(s.dtype, s.total) for s in spaces] == [(torch.float32, 25), (torch.float64, 2)]
    seen = {i: [] for i in range(len(params))}
    for r in range(world):
        by_space = {}
        for pc in pieces_of(spaces, [0] * len(params), r):
            seen[pc.index].append((pc.start, pc.stop))
            by_space.setdefault(pc.space, []).append(pc)
        for s, pcs in by_space.items():
            shard = math.ceil(spaces[s].total / world)
            assert sum(pc.numel for pc in pcs) == max(0, min(shard, spaces[s].total - r * shard))
            assert [pc.offset for pc in pcs] == [sum(q.numel for q in pcs[:k]) for k in range(len(pcs))]
    for i, ranges in seen.items():
        assert sorted(ranges)[0][0] == 0 and sum(b - a for a, b in ranges) == max(params[i].numel(), 1)


def test_spans_map_flat_ranges_to_parameter_elements():
    params = [torch.zeros(3, 4), torch.zeros(0), torch.zeros(5), torch.zeros(7)]
    space = plan_spaces(params, 2)[0]
    assert space.spans(10, 19) == [(0, 10, 12, 0), (2, 0, 5, 2), (3, 0, 2, 7)]
    assert space.spans(24, 30) == []
    for lo in range(24):
        for hi in range(lo, 25):
            assert sum(b - a for _, a, b, _ in space.spans(lo, hi)) == hi - lo


@pytest.mark.parametrize("cls,kw", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
                                    (torch.optim.Adam, dict(lr=0.01, amsgrad=True)),
                                    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5))])
def test_one_rank_steps_state_dict_and_lr_changes_like_torch(cls, kw):
    a, b = _model(), _model()
    za, tb = fanfold.ZeroRedundancyOptimizer(a.parameters(), cls, **kw), cls(b.parameters(), **kw)
    for seed in range(4):
        for opt in (za, tb):
            opt.param_groups[0]["lr"] *= 0.5
        _step(a, za, seed)
        _step(b, tb, seed)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0)
    za.consolidate_state_dict()
    mine, theirs = za.state_dict(), tb.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        assert mine["state"][i].keys() == s.keys()
        for k, v in s.items():
            torch.testing.assert_close(mine["state"][i][k], v, rtol=0, atol=0)
    # And back: the torch optimizer's state into a fresh ZeRO over a copy; both continue identically.
    c = copy.deepcopy(b)
    zc = fanfold.ZeroRedundancyOptimizer(c.parameters(), cls, **kw)
    zc.load_state_dict(theirs)
    _step(c, zc, 9)
    _step(b, tb, 9)
    for p, q in zip(c.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0)


def test_add_param_group_keeps_state_and_hyperparameters():
    a, b = _model(), _model()
    za = fanfold.ZeroRedundancyOptimizer(a[0].parameters(), torch.optim.Adam, lr=0.01)
    tb = torch.optim.Adam(b[0].parameters(), lr=0.01)
    _step(a, za, 0)
    _step(b, tb, 0)
    za.add_param_group({"params": a[2].parameters(), "lr": 0.1})
    tb.add_param_group({"params": b[2].parameters(), "lr": 0.1})
    assert za.param_groups[1]["betas"] == tb.param_groups[1]["betas"]
    for seed in (1, 2):
        _step(a, za, seed)
        _step(b, tb, seed)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0)


def test_errors_name_the_problem():
    m = _model()
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer subclass"):
        fanfold.ZeroRedundancyOptimizer(m.parameters(), "adam")
    with pytest.raises(TypeError, match="optimizer_class"):
        fanfold.ZeroRedundancyOptimizer(m.parameters(), dict)
    with pytest.raises(ValueError, match="LBFGS does not update each element independently"):
        fanfold.ZeroRedundancyOptimizer(m.parameters(), torch.optim.LBFGS)
    with pytest.raises(ValueError, match="overlap_with_ddp=True is not supported"):
        fanfold.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, overlap_with_ddp=True)
    opt = fanfold.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam)
    with pytest.raises(RuntimeError, match=r"call consolidate_state_dict\(to=0\) on every rank first"):
        opt.state_dict()
    opt.consolidate_state_dict()
    opt.state_dict()
    _step(m, opt, 0)
    with pytest.raises(RuntimeError, match="after the last step"):
        opt.state_dict()  # stale after a step
    with pytest.raises(ValueError, match="to=1 is not a rank"):
        opt.consolidate_state_dict(to=1)
    with pytest.raises(ValueError, match=r"parameter groups of sizes \[3\] in the state, \[4\]"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1, 2]}]})
    with pytest.raises(ValueError, match="not contiguous"):
        fanfold.ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(3, 4).t())], torch.optim.SGD, lr=0.1)
