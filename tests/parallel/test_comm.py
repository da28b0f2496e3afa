"""The device-copy autograd Functions (Broadcast, ReduceAdd, Scatter, Gather) on repeated CPU devices; torch ops are
the oracle."""
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from fanfold.parallel.functions import Broadcast, Gather, ReduceAdd, Scatter

CPU3 = ["cpu", "cpu", "cpu"]


def test_broadcast_gives_independent_copies():
    x = torch.randn(3, 2)
    copies = Broadcast.apply(CPU3, x)
    assert len(copies) == 3 and all(torch.equal(c, x) for c in copies)
    copies[0].add_(1)
    assert torch.equal(copies[1], x) and not torch.equal(copies[0], x)


def test_reduce_add_sums_in_order_onto_destination():
    ts = [torch.randn(4) for _ in range(3)]
    out = ReduceAdd.apply("cpu", *ts)
    assert torch.equal(out, ts[0] + ts[1] + ts[2])
    out.add_(1)
    assert not torch.equal(out, ts[0] + ts[1] + ts[2]) and not any(t is out for t in ts)


def test_scatter_and_gather_are_split_and_cat():
    x = torch.randn(10, 3)
    parts = Scatter.apply(CPU3, [2, 5, 3], 0, x)
    assert [p.shape[0] for p in parts] == [2, 5, 3]
    assert all(torch.equal(p, e) for p, e in zip(parts, x.split([2, 5, 3])))
    parts[0].zero_()
    assert x[:2].abs().sum() > 0  # no view of the input
    assert torch.equal(Gather.apply("cpu", 1, *x.split([1, 2], 1)), x)
    with pytest.raises(ValueError, match="devices is empty"):
        Broadcast.apply([], x)


def _double(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def test_functions_gradcheck():
    a, b = _double(3, 2), _double(4)
    assert gradcheck(lambda a, b: Broadcast.apply(CPU3, a, b), (a, b))
    assert gradgradcheck(lambda a, b: Broadcast.apply(CPU3, a, b), (a, b))
    assert gradcheck(lambda *ts: ReduceAdd.apply("cpu", *ts), (_double(3), _double(3), _double(3)))
    assert gradgradcheck(lambda *ts: ReduceAdd.apply("cpu", *ts), (_double(3), _double(3)))
    x = _double(7, 2)
    assert gradcheck(lambda x: Scatter.apply(CPU3, [3, 0, 4], 0, x), (x,))
    assert gradgradcheck(lambda x: Scatter.apply(CPU3, [3, 0, 4], 0, x), (x,))
    assert gradcheck(lambda *ts: Gather.apply("cpu", 1, *ts), (_double(2, 1), _double(2, 3)))
    assert gradgradcheck(lambda *ts: Gather.apply("cpu", 1, *ts), (_double(2, 1), _double(2, 3)))


def test_duals_give_the_expected_gradients():
    x = torch.randn(5, requires_grad=True)
    copies = Broadcast.apply(CPU3, x)
    sum(c * (i + 1) for i, c in enumerate(copies)).sum().backward()
    assert torch.equal(x.grad, torch.full((5,), 6.0))  # ReduceAdd of 1, 2, 3

    x.grad = None
    parts = Scatter.apply(["cpu", "cpu"], [2, 3], 0, x)
    (parts[0].sum() * 2 + parts[1].sum() * 3).backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 2, 3, 3, 3]))  # Gather of the chunk gradients


def test_gather_backward_is_torch_cat_backward():
    # the oracle is torch.cat: the same gradients, and on the gradient's device the same memory (views, not copies)
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    g = torch.randn(6, 3)
    Gather.apply("cpu", 0, a, b).backward(g)
    torch.cat([a2, b2]).backward(g)
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)
    assert [t.grad.data_ptr() == g.data_ptr() for t in (a, a2)] == [True, True]
    # double backward: a gradient penalty through Gather equals one through torch.cat
    x = _double(5, 2)
    x2 = x.detach().clone().requires_grad_()
    outs = []
    for t, cat in ((x, lambda *ts: Gather.apply("cpu", 0, *ts)), (x2, lambda *ts: torch.cat(ts))):
        y = cat(*(p * p for p in t.split([2, 3])))
        (grad,) = torch.autograd.grad(y, t, torch.ones_like(y) * 3, create_graph=True)
        outs.append(torch.autograd.grad(grad.pow(2).sum(), t)[0])
    torch.testing.assert_close(outs[0], outs[1])


def test_broadcast_of_a_frozen_tensor_does_not_require_grad():
    w, buf = torch.randn(2, requires_grad=True), torch.randn(2)
    outs = Broadcast.apply(["cpu", "cpu"], w, buf)
    assert [o.requires_grad for o in outs] == [True, False, True, False]
    (outs[0] + outs[2]).sum().backward()
    assert torch.equal(w.grad, torch.full((2,), 2.0))
