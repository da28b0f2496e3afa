"""fanfold.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_: unsharded it is torch's; over a
ZeroRedundancyOptimizer's slices (one rank here, several in test_zero_training) it returns the same norm and leaves
the gradients its step reads clipped as torch clips them."""
import math

import pytest
import torch

import fanfold


def _grads(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Linear(9, 2)).double()
    (m(torch.randn(5, 6, dtype=torch.float64)) ** 2).sum().backward()
    return m


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, -1.5, math.inf, -math.inf])
@pytest.mark.parametrize("max_norm", [0.1, 1e6])
@pytest.mark.parametrize("foreach", [None, True])
def test_unsharded_and_sharded_equal_torch(norm_type, max_norm, foreach):
    want_m, plain_m, zero_m = _grads(0), _grads(0), _grads(0)
    want = torch.nn.utils.clip_grad_norm_(want_m.parameters(), max_norm, norm_type)
    got = fanfold.clip_grad_norm_(plain_m.parameters(), max_norm, norm_type, foreach=foreach)
    opt = fanfold.ZeroRedundancyOptimizer(zero_m.parameters(), torch.optim.SGD, lr=0.1)
    sharded = fanfold.clip_grad_norm_(opt, max_norm, norm_type, foreach=foreach)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(sharded, want, rtol=1e-12, atol=0)
    for a, b, c in zip(want_m.parameters(), plain_m.parameters(), zero_m.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
        torch.testing.assert_close(c.grad, a.grad, rtol=1e-12, atol=0)


def test_nonfinite_norm_raises_when_asked():
    m = _grads(1)
    next(m.parameters()).grad[0, 0] = math.nan
    opt = fanfold.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="non-finite"):
        fanfold.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)


def test_zero_norm_refused_when_sharded_only():
    m = _grads(2)
    opt = fanfold.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="norm_type=0 is not supported over sharded gradients"):
        fanfold.clip_grad_norm_(opt, 1.0, norm_type=0)
    torch.testing.assert_close(fanfold.clip_grad_norm_(m.parameters(), 1e6, 0),
                               torch.nn.utils.clip_grad_norm_(_grads(2).parameters(), 1e6, 0))
