"""The CPU replicas' backward run in the worker threads (``parallel_backward.py``): gradients against the bare module
in the cases the mechanism has to get right (shared gradient memory, leaves that are not parameters, retain_graph,
autograd.grad), where the work runs, and its errors."""
import copy
import threading

import pytest
import torch
from torch import nn

from fanfold import DataParallel

TOL = dict(rtol=1e-6, atol=1e-6)


class ThreadRecorder(nn.Module):
    """Records on which thread the backward of its hidden activation runs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.threads = []  # a list shared with the replicas (their __dict__ is a shallow copy)

    def forward(self, x):
        h = self.fc(x)
        h.register_hook(lambda g: self.threads.append(threading.current_thread().name))
        return h.relu()


class SharedGradient(nn.Module):
    """Autograd hands ``a`` and ``b`` the same gradient tensor: summing in place into one would corrupt the other."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3))
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * (self.a + self.b)


class PlainAttribute(nn.Module):
    """A tensor that requires grad kept as a plain attribute (not a parameter), and a non-differentiable output."""

    def __init__(self, scale):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.scale = scale

    def forward(self, x):
        y = self.fc(x) * self.scale
        return {"y": y, "label": y.argmax(1)}


def grads(module):
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in module.parameters()]


def assert_same_grads(module, bare):
    for (name, e), g in zip(bare.named_parameters(), grads(module), strict=True):
        expected = torch.zeros_like(e) if e.grad is None else e.grad
        torch.testing.assert_close(g, expected, **TOL, msg=lambda m: f"{name}: {m}")


def test_backward_runs_on_the_worker_threads():
    m = ThreadRecorder()
    DataParallel(m, ["cpu"] * 2)(torch.randn(6, 4)).sum().backward()
    assert sorted(m.threads) == ["fanfold-replica-0", "fanfold-replica-1"]
    m.threads.clear()
    DataParallel(m, ["cpu"] * 2, parallel_backward=False)(torch.randn(6, 4)).sum().backward()
    assert m.threads == [threading.current_thread().name] * 2  # autograd's own way: all on the caller


@pytest.mark.parametrize("n", [2, 3])
def test_shared_gradient_tensor_is_not_summed_in_place(n):
    torch.manual_seed(0)
    bare = SharedGradient()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * n)
    x = torch.randn(7, 3)
    (bare(x) * torch.arange(3.0)).sum().backward()
    (dp(x) * torch.arange(3.0)).sum().backward()
    assert_same_grads(dp.module, bare)


def test_sparse_gradients_are_summed():
    torch.manual_seed(0)
    bare = nn.Embedding(10, 3, sparse=True)
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2)
    idx = torch.tensor([1, 4, 4, 9, 1, 0])
    bare(idx).pow(2).sum().backward()
    dp(idx).pow(2).sum().backward()
    assert dp.module.weight.grad.is_sparse
    torch.testing.assert_close(dp.module.weight.grad.to_dense(), bare.weight.grad.to_dense(), **TOL)


def test_plain_attribute_leaf_gets_its_gradient_and_outputs_keep_requires_grad():
    torch.manual_seed(0)
    bare = PlainAttribute(torch.tensor(2.0, requires_grad=True))
    model = copy.deepcopy(bare)
    dp = DataParallel(model, ["cpu"] * 2)
    x = torch.randn(6, 3)
    expected, got = bare(x), dp(x)
    assert got["label"].requires_grad is expected["label"].requires_grad is False
    assert torch.equal(got["label"], expected["label"])
    expected["y"].pow(2).sum().backward()
    got["y"].pow(2).sum().backward()
    torch.testing.assert_close(model.scale.grad, bare.scale.grad, **TOL)
    assert_same_grads(model, bare)


def test_replicas_may_modify_their_arguments_in_place():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            x.mul_(2)  # allowed on the bare module when x is not a leaf
            return self.fc(x)

    torch.manual_seed(0)
    bare = InPlace()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2)
    leaf = torch.randn(6, 4, requires_grad=True)
    for m in (bare, dp):
        m(leaf * 1).pow(2).sum().backward()
        if m is bare:
            expected, leaf.grad = leaf.grad, None
    torch.testing.assert_close(leaf.grad, expected, **TOL)
    assert_same_grads(dp.module, bare)


def test_a_parameter_hook_runs_once_on_the_summed_gradient():
    torch.manual_seed(0)
    bare = nn.Linear(3, 2)
    model = copy.deepcopy(bare)
    calls = {"bare": [], "dp": []}
    for key, m in (("bare", bare), ("dp", model)):
        # clipping in a hook is not linear: applied per replica it would give another gradient
        m.weight.register_hook(lambda g, key=key: calls[key].append(threading.current_thread().name) or g.clamp(-1, 1))
    x = torch.randn(8, 3) * 10
    bare(x).pow(2).sum().backward()
    DataParallel(model, ["cpu"] * 2)(x).pow(2).sum().backward()
    assert calls["dp"] == calls["bare"] == [threading.current_thread().name]
    # inputs scaled by 10 and squared: gradients of order 100 summed in another order (two halves) differ by a few
    # float32 ulps, so the absolute tolerance is that of the magnitudes here, not 1e-6
    for (name, e), g in zip(bare.named_parameters(), grads(model), strict=True):
        torch.testing.assert_close(g, e.grad, rtol=1e-6, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_retain_graph_and_a_second_backward():
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2)
    x = torch.randn(9, 5)
    for m in (bare, dp):
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # gradients accumulate: twice the one-backward gradient
        if m is dp:
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
    assert_same_grads(dp.module, bare)


def test_autograd_grad_returns_gradients_and_leaves_grad_alone():
    torch.manual_seed(0)
    bare = nn.Linear(5, 3)
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2)
    x = torch.randn(8, 5, requires_grad=True)
    expected = torch.autograd.grad(bare(x).pow(2).sum(), [x, *bare.parameters()])
    got = torch.autograd.grad(dp(x).pow(2).sum(), [x, *dp.module.parameters()])
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **TOL)
    assert all(p.grad is None for p in dp.module.parameters())


def _gradient_penalty_step(m, x):
    """A WGAN-GP style step: loss plus the squared norm of d(output)/d(input), backward through both."""
    x = x.clone().requires_grad_(True)
    out = m(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.pow(2).mean() + gx.pow(2).sum(1).sub(1).pow(2).mean()).backward()
    return out


@pytest.mark.filterwarnings("ignore:DataParallel. double backward")
@pytest.mark.parametrize("parallel_backward", [True, False])
def test_double_backward_gradient_penalty_matches_the_bare_module(parallel_backward):
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Softplus(), nn.Linear(8, 1))
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, parallel_backward=parallel_backward)
    x = torch.randn(6, 4)
    for _ in range(2):  # the second step accumulates into existing .grad
        expected = _gradient_penalty_step(bare, x)
        got = _gradient_penalty_step(dp, x)
        torch.testing.assert_close(got, expected, **TOL)
        assert_same_grads(dp.module, bare)
    # d2/dp through autograd.grad alone, with create_graph, too
    g_bare = torch.autograd.grad(bare(x).pow(2).sum(), list(bare.parameters()), create_graph=True)
    g_dp = torch.autograd.grad(dp(x).pow(2).sum(), list(dp.module.parameters()), create_graph=True)
    hvp_bare = torch.autograd.grad(sum(g.pow(2).sum() for g in g_bare), list(bare.parameters()))
    hvp_dp = torch.autograd.grad(sum(g.pow(2).sum() for g in g_dp), list(dp.module.parameters()))
    for g, e in zip(hvp_dp, hvp_bare, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:DataParallel. double backward")
def test_double_backward_keeps_batchnorm_statistics_and_refuses_dropout():
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2)
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match="forward is run again on the caller's thread"):  # the slower path, announced
        _gradient_penalty_step(dp, x)
    serial = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, parallel_backward=False)
    _gradient_penalty_step(serial, x)
    # the recomputation does not update the running statistics a second time
    torch.testing.assert_close(dp.module[1].running_mean, serial.module[1].running_mean, **TOL)
    assert int(dp.module[1].num_batches_tracked) == 1
    assert_same_grads(dp.module, serial.module)

    noisy = DataParallel(nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5), nn.Linear(64, 1)), ["cpu"] * 2)
    with pytest.raises(RuntimeError, match=r"replica \d.*outputs changed.*parallel_backward=False"):
        _gradient_penalty_step(noisy, x)


def test_an_error_in_a_replica_backward_names_the_replica():
    class Failing(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            h = self.fc(x)
            if x[0, 0] > 100:  # only the replica holding the marked row fails
                h.register_hook(lambda g: (_ for _ in ()).throw(ValueError("bad gradient")))
            return h

    x = torch.zeros(4, 2)
    x[2, 0] = 1000.0
    dp = DataParallel(Failing(), ["cpu"] * 2)
    with pytest.raises(ValueError, match=r"in replica 1 on device cpu: ValueError: bad gradient"):
        dp(x).sum().backward()
    dp(torch.zeros(4, 2)).sum().backward()  # the pool still works
