"""DDP edge cases on 2 gloo ranks: unused parameters in both modes (without find_unused_parameters: on one rank),
two forwards and one backward with BatchNorm and buffer broadcasting, state_dict without prefix, torch's keywords, a
model that differs between ranks, and the environment contract of init_process_group."""
import copy
import time
import warnings

import pytest
import torch
from torch import nn

import fanfold
from _ddp_models import optimizer
from fanfold.distributed import init_process_group, rank, world_size


class Branchy(nn.Module):
    """``b`` is used only when asked (rank 0 in the tests); ``never`` is used by no rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.never, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x, use_b):
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(x))
        return self.out(h)


class WithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def _data(step, r):
    g = torch.Generator().manual_seed(10 * step + r)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _gan_data(step, r):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g) * 2 + 1


def _gan_loss(model, real, fake):
    return model(real).mean() - model(fake).mean()  # two forwards, one backward


def _scenarios():
    device = init_process_group(timeout=60)
    r, out = rank(), {}
    fanfold.distributed.barrier()
    out["env"] = (r, world_size(), fanfold.distributed.local_rank(), fanfold.distributed.is_main_process(),
                  str(device), str(fanfold.distributed.device()))
    # find_unused_parameters=True: b is used on rank 0 only, never on no rank
    model = Branchy()
    ddp = fanfold.DDP(model, find_unused_parameters=True, bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0001)
    opt = optimizer(model, lr=0.1)
    for step in range(3):
        x, y = _data(step, r)
        opt.zero_grad()
        ((ddp(x, use_b=(r == 0)) - y) ** 2).mean().backward()
        if step == 0:
            out["grads"] = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    # find_unused_parameters=False: the rank that skipped b cannot finish the reduction; as torch's DDP it keeps
    # its own gradients and raises at its next forward with grad (torch's words, naming b); the other rank is not
    # left waiting (it completes its step, b averaged with the zeros the first contributed)
    model = Branchy()
    model.never.requires_grad_(False)
    ddp = fanfold.DDP(model)
    x, y = _data(0, r)
    ((ddp(x, use_b=(r == 0)) - y) ** 2).mean().backward()
    out["unfinished_grads"] = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    try:
        ddp(x, use_b=False)
        out["unused_error"] = None
    except RuntimeError as exc:
        out["unused_error"] = str(exc)
    # two forwards, one backward, with BatchNorm and buffer broadcasting (pytorch#22095)
    model = WithNorm()
    ddp = fanfold.DDP(model, broadcast_buffers=True)
    opt = optimizer(model, lr=0.1, momentum=0.0)
    for step in range(3):
        opt.zero_grad()
        _gan_loss(ddp, *_gan_data(step, r)).backward()
        opt.step()
    out["gan_params"] = [p.detach().clone() for p in model.parameters()]
    ddp.eval()
    ddp(_gan_data(9, r)[0])  # the next forward re-syncs buffers from rank 0 (eval: and leaves them alone)
    out["gan_buffers"] = [b.clone() for b in model.buffers()]
    # state_dict without prefix; torch-DDP-style prefixed keys load; attributes fall through
    sd = ddp.state_dict()
    out["keys"] = sorted(sd)
    ddp.load_state_dict({"module." + k: torch.zeros_like(v) for k, v in sd.items()})
    out["zeroed"] = float(sum(p.detach().abs().sum() for p in model.parameters()))
    out["net_is_module_net"] = ddp.net is model.net
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fanfold.DDP(WithNorm(), static_graph=True, check_reduction=True, mixed_precision=None, dim=0)
    out["warnings"] = [str(w.message) for w in caught]
    return out


def _oracle_unused():
    model = Branchy()
    opt = optimizer(model, lr=0.1)
    first = None
    for step in range(3):
        opt.zero_grad()
        loss = sum(((model(*_data(step, r)[:1], use_b=(r == 0)) - _data(step, r)[1]) ** 2).mean() for r in (0, 1))
        (loss / 2).backward()
        if step == 0:
            first = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return first, [p.detach().clone() for p in model.parameters()]


def _oracle_gan():
    """Each rank's half through its own BatchNorm statistics; gradients averaged; rank 0's running statistics."""
    model = WithNorm()
    opt = optimizer(model, lr=0.1, momentum=0.0)
    replicas = [copy.deepcopy(model) for _ in range(2)]
    for step in range(3):
        grads = []
        for r, rep in enumerate(replicas):
            # parameters from the model, buffers from rank 0 (the first forward of a step re-syncs them)
            rep.load_state_dict({**model.state_dict(), **dict(replicas[0].named_buffers())})
            rep.zero_grad()
            _gan_loss(rep, *_gan_data(step, r)).backward()
            grads.append([p.grad for p in rep.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    return [p.detach().clone() for p in model.parameters()], [b.clone() for b in replicas[0].buffers()]


def test_unused_parameters_buffers_state_dict_and_keywords():
    r0, r1 = fanfold.launch(_scenarios, nprocs=2, timeout=240)
    assert r0["env"] == (0, 2, 0, True, "cpu", "cpu") and r1["env"] == (1, 2, 1, False, "cpu", "cpu")
    first, params = _oracle_unused()
    for got in (r0, r1):
        assert got["grads"]["never.weight"] is None and got["grads"]["never.bias"] is None  # as in one process
        for name, g in first.items():
            if g is not None:
                assert torch.allclose(got["grads"][name], g, atol=1e-6), name
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got["params"], params))
    assert r0["unused_error"] is None
    msg = r1["unused_error"]
    assert "Expected to have finished reduction in the prior iteration" in msg
    assert "Parameters which did not receive grad for rank 1: b.weight, b.bias" in msg
    assert "find_unused_parameters=True" in msg
    own = Branchy()  # rank 1's own gradients, un-averaged; rank 0 has the average, b's over rank 0 alone / 2
    x1, y1 = _data(0, 1)
    ((own(x1, use_b=False) - y1) ** 2).mean().backward()
    for n, p in own.named_parameters():
        assert (p.grad is None and r1["unfinished_grads"][n] is None) or \
            torch.equal(r1["unfinished_grads"][n], p.grad), n
    both = Branchy()
    sum(((both(*_data(0, k)[:1], use_b=(k == 0)) - _data(0, k)[1]) ** 2).mean() for k in (0, 1)).div(2).backward()
    for n, p in both.named_parameters():
        if p.grad is not None:
            assert torch.allclose(r0["unfinished_grads"][n], p.grad, atol=1e-6), n
    gan_params, gan_buffers = _oracle_gan()
    for got in (r0, r1):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got["gan_params"], gan_params))
    for got in (r0, r1):  # rank 0's running statistics, on both ranks
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got["gan_buffers"], gan_buffers))
    assert r0["keys"] == sorted(WithNorm().state_dict()) and r0["zeroed"] == 0.0 and r0["net_is_module_net"]
    # torch's keywords have torch's meaning: check_reduction warns as deprecated (as in torch), nothing is ignored
    assert any("check_reduction" in w and "deprecated" in w for w in r0["warnings"])
    assert not any("ignored" in w or "not implemented" in w for w in r0["warnings"]), r0["warnings"]
    assert not any("mixed_precision" in w or "dim" in w for w in r0["warnings"])


def _mismatch():
    init_process_group(timeout=60)
    torch.manual_seed(0)
    width = 9 if rank() == 1 else 8
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, width), nn.Linear(width, 2))
    start = time.monotonic()
    try:
        fanfold.DDP(model)
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


def test_model_differing_between_ranks_fails_fast_with_the_first_mismatch():
    for msg, seconds in fanfold.launch(_mismatch, nprocs=2, timeout=120):
        assert msg is not None and seconds < 30  # at once, not after the group's 60 s timeout
        assert "differs between ranks [0, 1]" in msg
        assert "at entry 2 rank 0 has parameter '2.weight' shape (8, 8)" in msg
        assert "rank 1 has parameter '2.weight' shape (9, 8)" in msg


def test_init_process_group_without_environment_says_how_to_start(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"fanfold run") as e:
        init_process_group()
    assert "RANK" in str(e.value) and "fanfold.launch" in str(e.value)
    assert (rank(), world_size(), fanfold.distributed.local_rank()) == (0, 1, 0)
    assert fanfold.distributed.is_main_process() and fanfold.distributed.device() == torch.device("cpu")
    fanfold.distributed.barrier()  # a no-op without a group
    monkeypatch.setenv("RANK", "x")
    for name, value in (("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="RANK='x' is not an integer"):
        init_process_group()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="timeout must be positive"):
        init_process_group(timeout=-1)


def test_ddp_without_process_group_says_how_to_start():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fanfold.DDP(nn.Linear(2, 2))


def test_transport_choice_is_validated(monkeypatch):
    from fanfold.collectives.select import resolve_transport

    expected = "transport must be 'torch', 'shm', 'hierarchical' or a transport object, got 'nccl'"
    with pytest.raises(ValueError, match=expected):
        resolve_transport("nccl")
    monkeypatch.setenv("FANFOLD_TRANSPORT", "bogus")
    with pytest.raises(ValueError, match="FANFOLD_TRANSPORT must be"):
        resolve_transport(None)
    protocol = (r"\['all_reduce', 'reduce_tensors', 'reduce_scatter', 'reduce_scatter_tensors', 'all_gather', "
                r"'broadcast', 'barrier', 'rank', 'world_size'\]")
    with pytest.raises(TypeError, match=rf"lacks {protocol} of fanfold.collectives.Transport"):
        resolve_transport(object())
