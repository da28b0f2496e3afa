"""Nesting depth is limited by memory only: scatter, gather and DataParallel (thread and process engines) on inputs
and outputs nested far beyond Python's recursion limit behave as the bare module does (issue 26)."""
import sys

import pytest
import torch
from torch import nn

import fanfold
from fanfold import DataParallel


def nest(leaf, depth: int):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def unnest(obj):
    depth = 0
    while isinstance(obj, list):
        obj, depth = obj[0], depth + 1
    return obj, depth


class Deep(nn.Module):
    """Takes a tensor nested ``depth`` lists deep and returns its output nested as deep (walked iteratively, so the
    bare module itself runs at any depth)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, nested):
        x, depth = unnest(nested)
        return nest(self.lin(x), depth)


@pytest.mark.parametrize("depth", [2_000, 50_000])
def test_scatter_and_gather_at_any_depth(depth):
    x = torch.arange(12.0).view(4, 3)
    parts = fanfold.scatter(nest(x, depth), ["cpu", "cpu"])
    assert [unnest(p)[1] for p in parts] == [depth, depth]
    assert torch.equal(unnest(parts[0])[0], x[:2]) and torch.equal(unnest(parts[1])[0], x[2:])
    out, got_depth = unnest(fanfold.gather(parts, "cpu"))
    assert got_depth == depth and torch.equal(out, x)


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_data_parallel_at_a_depth_beyond_the_recursion_limit(engine):
    depth = 3 * sys.getrecursionlimit()
    torch.manual_seed(0)
    bare = Deep()
    x = torch.randn(6, 3)
    want, want_depth = unnest(bare(nest(x, depth)))
    want.sum().backward()
    want_grad = bare.lin.weight.grad.clone()
    bare.lin.weight.grad = None
    dp = DataParallel(bare, ["cpu", "cpu"], engine=engine)
    try:
        got, got_depth = unnest(dp(nest(x, depth)))
        got.sum().backward()
    finally:
        if engine == "process":
            dp.close()
    assert got_depth == want_depth == depth
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(bare.lin.weight.grad, want_grad)


def test_a_structure_that_contains_itself_is_refused_by_name():
    loop: list = [torch.zeros(2, 1)]
    loop.append(loop)
    with pytest.raises(ValueError, match=r"inputs\[0\]\[1\] contains itself"):
        fanfold.scatter((loop,), ["cpu", "cpu"])
