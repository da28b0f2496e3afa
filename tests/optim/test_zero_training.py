"""fanfold.ZeroRedundancyOptimizer on 2 and 3 gloo ranks against one process training on the whole batch with the
plain torch optimizer (SGD with momentum, Adam, AdamW), 20 steps: with fanfold DDP, clipping and no_sync
accumulation (2 ranks); without DDP (3 ranks, gradients averaged by hand as torch's ZeRO expects); a checkpoint saved
at 2 ranks and resumed at 3 and in a plain torch optimizer; parameters that differ between ranks; state memory.

Models are float64: Adam divides by sqrt(v), which turns float32 summation-order differences (DDP averages per
rank, the oracle sums the whole batch) into differences above rtol 1e-6.
"""
import math

import pytest
import torch
import torch.distributed as dist

import fanfold
from _ddp_models import batch, mlp
from fanfold.distributed import init_process_group

OPTS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
}
STEPS, MICRO, ROWS, MAX_NORM, SAVE_AT = 20, 2, 12, 0.5, 10


def _model():
    return mlp().double()


def _data(step, micro, rank=0, world=1):
    x, y = batch("mlp", step * MICRO + micro, n=ROWS)
    per = ROWS // world
    return x[rank * per:(rank + 1) * per].double(), y[rank * per:(rank + 1) * per].double()


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def oracle(name, opt=None, model=None, start=0):
    """Steps ``start..STEPS-1`` on the whole batch with torch's optimizer and torch's clipping; the parameters and
    the largest norm seen (so that the tests can check clipping was active)."""
    model = model or _model()
    cls, kw = OPTS[name]
    opt = opt or cls(model.parameters(), **kw)
    biggest = 0.0
    for step in range(start, STEPS):
        opt.zero_grad()
        for m in range(MICRO):
            _loss(model, *_data(step, m)).backward()
        biggest = max(biggest, float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], biggest


def _state_elements(optim):
    return sum(t.numel() for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def _report(model, opt, norms):
    return {"params": [p.detach().clone() for p in model.parameters()], "state": _state_elements(opt.optim),
            "pieces": len(opt._pieces), "norms": norms}


def _train_ddp(name, path=None):
    model = _model()
    ddp = fanfold.DistributedDataParallel(model, bucket_cap_mb=0.01, first_bucket_cap_mb=0.005)
    cls, kw = OPTS[name]
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
    r, n, norms = dist.get_rank(), dist.get_world_size(), []
    for step in range(STEPS):
        if path is not None and step == SAVE_AT:
            fanfold.save(path, {"model": ddp, "optimizer": opt, "step": step})
        opt.zero_grad()
        with ddp.no_sync():
            _loss(ddp, *_data(step, 0, r, n)).backward()
        _loss(ddp, *_data(step, 1, r, n)).backward()
        norms.append(float(fanfold.clip_grad_norm_(opt, MAX_NORM)))
        opt.step()
    return _report(model, opt, norms)


def _two_ranks(path):
    init_process_group(timeout=60)
    fanfold.optim.zero.GATHER_ELEMENTS = 1000  # the all-gather in several rounds, the last one partial
    return {name: _train_ddp(name, path if name == "adam" else None) for name in OPTS}


def _average_grads(model):
    n = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= n


def _train_plain(name, path=None):
    model = _model()
    cls, kw = OPTS[name]
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
    start = 0
    if path is not None:
        start = fanfold.load(path, {"model": model, "optimizer": opt})["step"]
    r, n, norms = dist.get_rank(), dist.get_world_size(), []
    for step in range(start, STEPS):
        opt.zero_grad()
        for m in range(MICRO):
            _loss(model, *_data(step, m, r, n)).backward()
        _average_grads(model)
        norms.append(float(fanfold.clip_grad_norm_(opt, MAX_NORM)))
        opt.step()
    return _report(model, opt, norms)


def _three_ranks(path):
    init_process_group(timeout=60)
    fanfold.optim.zero.GATHER_ELEMENTS = 999
    out = {name: _train_plain(name) for name in OPTS}
    out["resumed"] = _train_plain("adam", path)
    out["tiny"] = _tiny(zero=True)
    wrong = torch.nn.Linear(4, 3 if dist.get_rank() == 2 else 2)
    try:
        fanfold.ZeroRedundancyOptimizer(wrong.parameters(), torch.optim.Adam)
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def _tiny(zero):
    """Two elements over three ranks: the last rank's slice is empty. (final parameter, state dict, pieces)"""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    kw = dict(lr=0.5, momentum=0.9)
    opt = fanfold.ZeroRedundancyOptimizer([p], torch.optim.SGD, **kw) if zero else torch.optim.SGD([p], **kw)
    for k in range(2):
        p.grad = torch.tensor([1.0, -3.0 + k], dtype=torch.float64)
        opt.step()
    if not zero:
        return p.detach().clone(), opt.state_dict(), 1
    opt.consolidate_state_dict(to=0)
    return p.detach().clone(), opt.state_dict() if dist.get_rank() == 0 else None, len(opt._pieces)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("zero") / "adam.pt"


@pytest.fixture(scope="module")
def two_ranks(checkpoint):
    return fanfold.launch(_two_ranks, str(checkpoint), nprocs=2, timeout=300)


@pytest.fixture(scope="module")
def three_ranks(two_ranks, checkpoint):
    return fanfold.launch(_three_ranks, str(checkpoint), nprocs=3, timeout=300)


def _assert_params(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def _assert_memory(results, name, world):
    # The plain optimizer's state: T elements per elementwise entry (1 for SGD's momentum, 2 for Adam's moments)
    # plus one 'step' per parameter for Adam(W). Each rank holds 1/N of the elementwise entries (ceil(T/N) at most)
    # and one 'step' per piece it steps, at most one piece per parameter.
    model = _model()
    cls, kw = OPTS[name]
    plain = cls(model.parameters(), **kw)
    _loss(model, *_data(0, 0)).backward()
    plain.step()
    total, params, per = _state_elements(plain), len(plain.param_groups[0]["params"]), 1 if name == "sgd" else 2
    flat = sum(p.numel() for p in model.parameters())
    for r, res in enumerate(results):
        steps = 0 if name == "sgd" else res[name]["pieces"]
        assert res[name]["state"] <= total / world + params, (r, res[name]["state"], total)
        assert res[name]["state"] == per * max(0, min(math.ceil(flat / world), flat - r * math.ceil(flat / world))) \
            + steps


@pytest.mark.parametrize("name", list(OPTS))
def test_two_ranks_ddp_no_sync_clipping_equal_single_process(two_ranks, name):
    want, biggest = oracle(name)
    assert biggest > MAX_NORM  # clipping was active
    for res in two_ranks:
        _assert_params(res[name]["params"], want)
    assert two_ranks[0][name]["norms"] == two_ranks[1][name]["norms"]
    _assert_memory(two_ranks, name, 2)


@pytest.mark.parametrize("name", list(OPTS))
def test_three_ranks_without_ddp_equal_single_process(three_ranks, name):
    want, _ = oracle(name)
    for res in three_ranks:
        _assert_params(res[name]["params"], want)
    _assert_memory(three_ranks, name, 3)


def test_saved_at_two_ranks_resumes_at_three(three_ranks):
    want, _ = oracle("adam")
    for res in three_ranks:
        _assert_params(res["resumed"]["params"], want)


def test_saved_sharded_state_loads_into_plain_torch_optimizer(two_ranks, checkpoint):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), **OPTS["adam"][1])
    start = fanfold.load(checkpoint, {"model": model, "optimizer": opt}, rng=False)["step"]
    assert start == SAVE_AT and len(opt.state) == len(list(model.parameters()))
    got, _ = oracle("adam", opt=opt, model=model, start=start)
    _assert_params(got, oracle("adam")[0])


def test_parameters_differing_between_ranks_raise_on_every_rank(three_ranks):
    for r, res in enumerate(three_ranks):
        assert "rank 2's parameters differ from rank 0's" in res.get("mismatch", ""), r


def test_a_rank_with_an_empty_slice(three_ranks):
    want, want_sd, _ = _tiny(zero=False)
    assert [res["tiny"][2] for res in three_ranks] == [1, 1, 0]
    for res in three_ranks:
        torch.testing.assert_close(res["tiny"][0], want, rtol=0, atol=0)
    got_sd = three_ranks[0]["tiny"][1]
    assert got_sd["param_groups"] == want_sd["param_groups"]
    torch.testing.assert_close(got_sd["state"][0]["momentum_buffer"], want_sd["state"][0]["momentum_buffer"])
