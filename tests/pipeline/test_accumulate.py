"""A pipeline step's weight gradients, computed over blocks of micro-batches (``stage.WeightGradAccumulator``).

Oracle: autograd's own accumulation (the same micro-batches, each ``backward()`` adding into ``.grad``) and the
sequential model on the whole batch. float64, so that only summation order differs.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import fanfold
from fanfold.pipeline.stage import WeightGradAccumulator


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 3)).double()


def _autograd_grads(model: nn.Module, x: torch.Tensor, chunks: int, fused: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    acc = WeightGradAccumulator()
    for xc in x.chunk(chunks):
        if fused:
            with acc.linears(model):
                model(xc).pow(2).sum().backward()
        else:
            model(xc).pow(2).sum().backward()
        acc.step()
    return [p.grad.clone() for p in model.parameters()]


def test_equals_autograd_accumulation_and_writes_in_place():
    model, x = _model(), torch.randn(12, 6, dtype=torch.float64)
    expected = _autograd_grads(model, x, 4, fused=False)
    model.zero_grad(set_to_none=True)
    acc = WeightGradAccumulator()
    for xc in x.chunk(4):
        before = None if model[0].weight.grad is None else model[0].weight.grad.clone()
        with acc.linears(model):
            model(xc).pow(2).sum().backward()
        # backward gave autograd the input gradients only: the weight gradients wait for step()
        assert (model[0].weight.grad is None) if before is None else torch.equal(model[0].weight.grad, before)
        acc.step()
        assert model[0].weight.grad is not None and (before is None or not torch.equal(model[0].weight.grad, before))
    assert_close([p.grad for p in model.parameters()], expected)
    # a .grad that exists already is added into, the same tensor (no fresh tensor per micro-batch)
    before = [p.grad for p in model.parameters()]
    with acc.linears(model):
        model(x).pow(2).sum().backward()
    acc.step()
    assert all(p.grad is g for p, g in zip(model.parameters(), before))
    assert_close([p.grad for p in model.parameters()], [2 * e for e in expected])
    assert all("forward" not in vars(m) for m in model.modules())  # restored on the way out


def test_layers_it_must_leave_to_autograd():
    class Scaled(nn.Linear):  # a subclass may compute something else: left alone
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4)).double()
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(g.shape))  # a hook expects autograd's accumulation
    x = torch.randn(6, 4, dtype=torch.float64)
    expected = _autograd_grads(model, x, 3, fused=False)
    calls.clear()
    assert_close(_autograd_grads(model, x, 3, fused=True), expected)
    assert len(calls) == 3  # the hooked weight still went through autograd, once per micro-batch


def test_forward_restored_after_an_error():
    model = _model()
    with pytest.raises(RuntimeError):
        with WeightGradAccumulator().linears(model):
            model(torch.randn(2, 5, dtype=torch.float64))  # wrong width
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_step_accumulates_across_steps_like_the_sequential_model(schedule):
    torch.set_num_threads(1)
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    ref = _model()
    for _ in range(2):  # two steps without zero_grad: gradients add up
        nn.functional.mse_loss(ref(x), y).backward()
    pipe = fanfold.Pipeline(_model(), [2, 3], ["cpu", "cpu"], chunks=4)
    for _ in range(2):
        pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule)
    assert_close([p.grad for p in pipe.parameters()], [p.grad for p in ref.parameters()])
    assert all("forward" not in vars(m) for m in pipe.modules())
