"""DataParallel on CPU replicas against the bare module (the oracle): outputs, gradients, SGD steps, state dicts,
what a forward keeps, attribute fall-through and every error message."""
import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

import fanfold
from fanfold import DataParallel, data_parallel, unwrap

TOL = dict(rtol=1e-6, atol=1e-6)
REPLICAS = [1, 2, 3, 8]


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.max_pool2d(torch.relu(self.conv(x)), 2), 1))


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4)

    def forward(self, packed):
        return self.lstm(packed)[0]  # a PackedSequence: gathered by sequences


class KwargsDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x, *, mask, scale=1.0):
        y = self.fc(x) * scale
        return {"y": y, "masked": (y * mask).sum(1), "pair": (y.relu(), x.mean(1))}


def linear_case():
    return nn.Linear(5, 2), (torch.randn(30, 5, requires_grad=True),), {}


def cnn_case():
    return CNN(), (torch.randn(20, 1, 8, 8),), {}


def lstm_case():
    lengths = [5, 2, 7, 3, 1, 6, 4, 4, 2, 5, 3, 6]
    return PackedLSTM(), (pack_sequence([torch.randn(n, 3) for n in lengths], enforce_sorted=False),), {}


def kwargs_case():
    return KwargsDict(), (torch.randn(17, 5),), {"mask": torch.rand(17, 3), "scale": 0.5}


def as_tensors(out):
    """The output's tensors in a fixed order (a PackedSequence as its padded tensor and lengths)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, nn.utils.rnn.PackedSequence):
        padded, lengths = pad_packed_sequence(out, batch_first=True)
        return [padded, lengths.float()]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in as_tensors(out[k])]
    return [t for x in out for t in as_tensors(x)]


def loss_of(out):
    # fixed random weights per element make every gradient entry depend on its own output
    gen = torch.Generator().manual_seed(1)
    return sum((t * torch.randn(t.shape, generator=gen)).sum() for t in as_tensors(out) if t.requires_grad)


@pytest.mark.parametrize("parallel_backward", [True, False], ids=["parallel_backward", "autograd_backward"])
@pytest.mark.parametrize("case", [linear_case, cnn_case, lstm_case, kwargs_case])
@pytest.mark.parametrize("n", REPLICAS)
def test_outputs_and_gradients_equal_the_bare_module(case, n, parallel_backward):
    torch.manual_seed(0)
    bare, args, kwargs = case()
    dp = DataParallel(copy.deepcopy(bare), device_ids=["cpu"] * n, parallel_backward=parallel_backward)
    expected, got = bare(*args, **kwargs), dp(*args, **kwargs)
    assert type(got) is type(expected)
    for g, e in zip(as_tensors(got), as_tensors(expected), strict=True):
        torch.testing.assert_close(g, e, **TOL)
    x = args[0] if isinstance(args[0], torch.Tensor) and args[0].requires_grad else None
    loss_of(expected).backward()
    expected_input_grad = None if x is None else x.grad.clone()
    if x is not None:
        x.grad = None
    loss_of(got).backward()
    for (name, p), q in zip(bare.named_parameters(), dp.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m: f"{name}: {m}")
    if x is not None:
        torch.testing.assert_close(x.grad, expected_input_grad, **TOL)


@pytest.mark.parametrize("n", [2, 3])
def test_ten_sgd_steps_equal_one_device(n):
    torch.manual_seed(0)
    bare = CNN()
    model = copy.deepcopy(bare)
    dp = DataParallel(model, device_ids=["cpu"] * n)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (bare, dp)]
    for step in range(10):
        x, y = torch.randn(24, 1, 8, 8), torch.randint(0, 3, (24,))
        for m, opt in zip((bare, dp), opts):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for (name, p), q in zip(bare.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, **TOL, msg=lambda m: f"{name}: {m}")


def test_no_device_ids_on_a_cpu_only_machine_runs_the_module():
    if fanfold._core.devices.default_device_ids():
        pytest.skip("this machine has accelerators")
    m = nn.Linear(3, 2)
    dp = DataParallel(m)
    assert dp.device_ids == []
    x = torch.randn(4, 3)
    assert torch.equal(dp(x), m(x))


def test_batch_smaller_than_the_devices_and_no_tensor_inputs():
    torch.manual_seed(0)
    m = nn.Linear(5, 2)
    dp = DataParallel(m, ["cpu"] * 3)
    x = torch.randn(1, 5)
    torch.testing.assert_close(dp(x), m(x), **TOL)  # one replica used

    class NoArgs(nn.Module):
        def forward(self):
            return "called once"

    assert DataParallel(NoArgs(), ["cpu"] * 3)() == "called once"


def test_no_grad_forward_detaches_replicas():
    dp = DataParallel(nn.Linear(3, 2), ["cpu"] * 2)
    with torch.no_grad():
        assert not dp(torch.randn(4, 3)).requires_grad


def test_data_parallel_function():
    torch.manual_seed(0)
    m = KwargsDict()
    x, mask = torch.randn(9, 5), torch.rand(9, 3)
    got = data_parallel(m, x, ["cpu"] * 3, module_kwargs={"mask": mask})
    for g, e in zip(as_tensors(got), as_tensors(m(x, mask=mask))):
        torch.testing.assert_close(g, e, **TOL)
    lin = nn.Linear(5, 2)
    torch.testing.assert_close(data_parallel(lin, (x,), ["cpu", "cpu"], output_device="cpu"), lin(x), **TOL)


def test_weights_and_chunk_sizes_split_unequally():
    seen = []

    class Sizes(nn.Linear):
        def forward(self, x):
            seen.append(len(x))
            return super().forward(x)

    m = Sizes(2, 2)
    x = torch.randn(8, 2)
    torch.testing.assert_close(DataParallel(m, ["cpu"] * 2, weights=[3, 1])(x), m(x), **TOL)
    DataParallel(m, ["cpu"] * 3, chunk_sizes=[1, 2, 5])(x)
    assert sorted(seen[:2]) == [2, 6] and sorted(seen[3:6]) == [1, 2, 5]


# ---- what a forward keeps: buffers from the first replica only; attributes set in forward are lost ----

def test_batchnorm_running_stats_come_from_the_first_chunk():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    oracle = copy.deepcopy(bn)
    x = torch.randn(10, 3) * 3 + 1
    DataParallel(bn, ["cpu"] * 2)(x)
    oracle(x[:5])
    torch.testing.assert_close(bn.running_mean, oracle.running_mean, **TOL)
    torch.testing.assert_close(bn.running_var, oracle.running_var, **TOL)
    assert bn.num_batches_tracked.item() == 1


class Remember(nn.Linear):
    def forward(self, x):
        self.last_batch = len(x)
        return super().forward(x)


def test_attributes_set_in_forward_are_lost_with_several_replicas():
    m = Remember(2, 2)
    DataParallel(m, ["cpu"] * 2)(torch.randn(6, 2))
    assert not hasattr(m, "last_batch")
    DataParallel(m, ["cpu"])(torch.randn(6, 2))  # one device: the module itself runs
    assert m.last_batch == 6


# ---- state_dict / load_state_dict ----

def block():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def keys_and_values_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_state_dict_has_no_module_prefix_at_any_depth():
    torch.manual_seed(0)
    inner = block()
    bare = nn.Sequential(nn.Linear(2, 3), inner, nn.Linear(4, 1))
    wrapped = nn.Sequential(bare[0], DataParallel(DataParallel(inner, ["cpu"] * 2), ["cpu"]), bare[2])
    keys_and_values_equal(wrapped.state_dict(), bare.state_dict())
    keys_and_values_equal(DataParallel(bare, ["cpu"] * 2).state_dict(), bare.state_dict())
    assert wrapped.state_dict()._metadata["1.1"] == bare.state_dict()._metadata["1.1"]  # BatchNorm's version


def test_load_state_dict_accepts_prefixed_and_unprefixed_keys():
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(2, 3), block())
    source[1][1].running_mean.uniform_()
    unprefixed = source.state_dict()
    prefixed_root = nn.DataParallel(source).state_dict()  # torch's keys: module.0.weight, ...
    assert all(k.startswith("module.") for k in prefixed_root)
    for sd in (unprefixed, prefixed_root):
        target = DataParallel(nn.Sequential(nn.Linear(2, 3), block()), ["cpu"] * 2)
        assert target.load_state_dict(sd) is not None
        keys_and_values_equal(target.state_dict(), unprefixed)
    # nested: a DataParallel sub-block, keys with and without "module." inside
    nested_prefixed = {k.replace("1.", "1.module.", 1) if k.startswith("1.") else k: v for k, v in unprefixed.items()}
    for sd in (unprefixed, nested_prefixed):
        target = nn.Sequential(nn.Linear(2, 3), DataParallel(block(), ["cpu"] * 2))
        target.load_state_dict(sd)
        keys_and_values_equal(target.state_dict(), unprefixed)
    # and back into the bare module
    fresh = nn.Sequential(nn.Linear(2, 3), block())
    fresh.load_state_dict(DataParallel(source, ["cpu"]).state_dict())
    keys_and_values_equal(fresh.state_dict(), unprefixed)


def test_wrapped_module_with_a_child_named_module():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    src = Holder()
    for sd in (src.state_dict(), nn.DataParallel(src).state_dict()):  # module.weight / module.module.weight
        target = DataParallel(Holder(), ["cpu"])
        target.load_state_dict(sd)
        assert torch.equal(target.module.module.weight, src.module.weight)


def test_load_state_dict_still_reports_bad_keys():
    target = DataParallel(block(), ["cpu"] * 2)
    sd = block().state_dict()
    sd["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match='Unexpected key.*"module.extra"'):
        target.load_state_dict(sd)
    del sd["extra"], sd["0.bias"]
    with pytest.raises(RuntimeError, match='Missing key.*"module.0.bias"'):
        target.load_state_dict(sd)


# ---- attributes, copies, unwrap ----

def test_attribute_access_falls_through():
    m = KwargsDict()
    m.note = "hello"
    dp = DataParallel(m, ["cpu"] * 2)
    assert dp.fc is m.fc and dp.note == "hello" and dp.module is m
    with pytest.raises(AttributeError, match="neither DataParallel nor the module it wraps \\(KwargsDict\\) has an "
                                             "attribute 'nope'"):
        dp.nope


def test_copy_and_pickle_after_a_forward():
    dp = DataParallel(nn.Linear(3, 2), ["cpu"] * 2)
    x = torch.randn(4, 3)
    out = dp(x)
    for clone in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        torch.testing.assert_close(clone(x), out, **TOL)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised by torch.compile's own imports
def test_unwrap_peels_every_wrapper():
    m = nn.Linear(2, 2)
    assert unwrap(m) is m
    assert unwrap(DataParallel(nn.DataParallel(DataParallel(m, ["cpu"] * 2)), ["cpu"])) is m
    assert unwrap(DataParallel(torch.compile(m), ["cpu"])) is m
    with pytest.raises(TypeError, match="unwrap: expected an nn.Module"):
        unwrap(torch.optim.SGD(m.parameters(), lr=1))


# ---- errors ----

def test_error_empty_device_ids():
    with pytest.raises(ValueError, match=r"device_ids is empty: give at least one device"):
        DataParallel(nn.Linear(2, 2), device_ids=[])


def test_error_accelerator_ids_without_an_accelerator():
    if fanfold._core.devices.accelerator_type() is not None:
        pytest.skip("this machine has an accelerator")
    with pytest.raises(ValueError, match=r"device_ids\[0\] is cuda:0, but this machine has no cuda device; for CPU "
                                         r"replicas give device_ids=\['cpu'\] \* 2"):
        DataParallel(nn.Linear(2, 2), [0, 1])


def test_error_parameter_not_on_the_first_device():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m[1].bias = nn.Parameter(torch.empty(2, device="meta"))
    with pytest.raises(RuntimeError, match=r"must be on device_ids\[0\] = cpu, but 1.bias is on meta"):
        DataParallel(m, ["cpu"] * 2)(torch.randn(4, 2))


def test_error_wrapping_an_optimizer():
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"DataParallel wraps an nn.Module \(your model\), got torch.optim.sgd.SGD\. "
                                        r"Optimizers and LR schedulers need no wrapping"):
        DataParallel(opt)
    with pytest.raises(TypeError, match="Optimizers and LR schedulers"):
        DataParallel(torch.optim.lr_scheduler.StepLR(opt, 1))


def test_error_inside_a_replica():
    class Picky(nn.Linear):
        def forward(self, x):
            if (x < 0).all():
                raise ValueError("negative batch")
            return super().forward(x)

    dp = DataParallel(Picky(1, 1), ["cpu"] * 3)
    x = torch.tensor([[1.0], [2.0], [-1.0], [-2.0], [3.0], [4.0]])
    with pytest.raises(ValueError, match="in replica 1 on device cpu: ValueError: negative batch"):
        dp(x)
    assert dp(x.abs()).shape == (6, 1)  # the pool is still usable


def test_error_replicas_returning_different_structures():
    class Shifty(nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            return {"y": y} if x[0, 0] > 0 else {"z": y}

    x = torch.tensor([[1.0], [2.0], [-1.0], [-2.0]])
    with pytest.raises(ValueError, match="replica 1 returned a different structure than replica 0"):
        DataParallel(Shifty(1, 1), ["cpu"] * 2)(x)


def test_error_bad_arguments():
    with pytest.raises(TypeError, match="dim must be an int"):
        DataParallel(nn.Linear(2, 2), ["cpu"], dim="0")
    with pytest.raises(ValueError, match="weights or chunk_sizes, not both"):
        DataParallel(nn.Linear(2, 2), ["cpu"] * 2, weights=[1, 1], chunk_sizes=[1, 1])
    with pytest.raises(ValueError, match="3 weights for 2 device_ids"):
        DataParallel(nn.Linear(2, 2), ["cpu"] * 2, weights=[1, 1, 1])
    with pytest.raises(ValueError, match=r"dim 2 is out of range for inputs\[0\]"):
        DataParallel(nn.Linear(2, 2), ["cpu"] * 2, dim=2)(torch.randn(4, 2))


@pytest.mark.gpu
def test_gpu_replicas_and_differentiable_copies_across_devices():
    torch.manual_seed(0)
    bare = CNN().cuda()
    dp = DataParallel(copy.deepcopy(bare), ["cuda:0", "cuda:0"])
    x = torch.randn(20, 1, 8, 8, device="cuda")
    loss_of(bare(x).cpu()).backward()
    loss_of(dp(x).cpu()).backward()
    for p, q in zip(bare.parameters(), dp.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-3)  # cuDNN may use TF32 convolutions
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    r_cpu, r_gpu = fanfold.replicate(lin, ["cpu", "cuda:0"])
    assert r_gpu.weight.device.type == "cuda" and r_gpu.weight.grad_fn is not None
    (r_cpu(x).sum() + r_gpu(x.cuda()).sum()).backward()
    expected = torch.autograd.grad(lin(x).sum(), lin.weight)[0] * 2
    torch.testing.assert_close(lin.weight.grad, expected, rtol=1e-5, atol=1e-5)
