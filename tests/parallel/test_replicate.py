"""replicate(): what replicas share with the original and what they copy; the original module is the oracle."""
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

from fanfold import replicate


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3, bias=False))


def test_same_device_replicas_reuse_parameters_and_are_new_modules():
    m = net()
    replicas = replicate(m, ["cpu"] * 3)
    assert len(replicas) == 3
    for r in replicas:
        assert r is not m and type(r) is type(m)
        assert r[0] is not m[0] and r[1] is not m[1]
        assert r[0].weight is m[0].weight and r[3].weight is m[3].weight  # the Parameter objects themselves
        assert r[3].bias is None
        assert [p is q for p, q in zip(r.parameters(), m.parameters())] == [True] * 5
    assert len({id(r[0]) for r in replicas}) == 3


def test_buffers_shared_by_the_first_replica_copied_for_the_others():
    m = net()
    m[1].running_mean.uniform_()
    r0, r1, r2 = replicate(m, ["cpu"] * 3)
    assert r0[1].running_mean is m[1].running_mean
    for r in (r1, r2):
        assert r[1].running_mean.data_ptr() != m[1].running_mean.data_ptr()
        assert torch.equal(r[1].running_mean, m[1].running_mean)
    assert r1[1].running_mean.data_ptr() != r2[1].running_mean.data_ptr()
    # in-place updates on a copy stay in the copy
    r1(torch.randn(5, 4))
    assert not torch.equal(r1[1].running_mean, m[1].running_mean)


def test_replica_outputs_and_gradients_reach_the_original():
    m = net().eval()
    x = torch.randn(7, 4)
    expected = m(x)
    expected.sum().backward()
    single = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    replicas = replicate(m, ["cpu"] * 3)
    outs = [r(x) for r in replicas]
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    sum(o.sum() for o in outs).backward()
    for p, g in zip(m.parameters(), single):
        torch.testing.assert_close(p.grad, 3 * g, rtol=1e-6, atol=1e-6)


def test_detach_gives_no_gradient_path():
    m = net().eval()
    (r,) = replicate(m, ["cpu"], detach=True)
    assert not r[0].weight.requires_grad
    assert r[0].weight.data_ptr() == m[0].weight.data_ptr()  # detached, not copied
    out = r(torch.randn(3, 4))
    assert not out.requires_grad


def test_other_device_gets_differentiable_copies():
    # "meta" stands in for a second device on a CPU-only machine: the copies are new, non-leaf, tracked tensors
    m = net()
    r_cpu, r_meta = replicate(m, ["cpu", "meta"])
    assert r_cpu[0].weight is m[0].weight
    w = r_meta[0].weight
    assert w.device.type == "meta" and not isinstance(w, nn.Parameter)
    assert w.requires_grad and w.grad_fn is not None
    assert r_meta[1].running_mean.device.type == "meta" and not r_meta[1].running_mean.requires_grad
    assert m[0].weight.device.type == "cpu"  # the original is untouched


def test_tied_parameters_stay_tied():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    m = nn.Sequential(a, b)
    (r,) = replicate(m, ["meta"])
    assert r[0].weight is r[1].weight


def test_lstm_replica_uses_its_own_weights_list():
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 5)
    seqs = pack_sequence([torch.randn(4, 3), torch.randn(2, 3)])
    r0, r1 = replicate(lstm, ["cpu", "cpu"])
    assert r0._flat_weights is not lstm._flat_weights
    torch.testing.assert_close(r1(seqs)[0].data, lstm(seqs)[0].data, rtol=0, atol=0)


def test_attributes_set_in_a_replica_stay_in_the_replica():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            self.calls += 1
            return self.fc(x)

    m = Counter()
    (r,) = replicate(m, ["cpu"])
    r(torch.randn(1, 2))
    assert r.calls == 1 and m.calls == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="network must be an nn.Module"):
        replicate(torch.optim.SGD(net().parameters(), lr=0.1), ["cpu"])
    with pytest.raises(ValueError, match="devices is empty"):
        replicate(net(), [])
