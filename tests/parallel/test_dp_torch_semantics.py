"""torch's DataParallel semantics (its test/distributed/test_data_parallel.py, multi-GPU only there) on CPU replicas:
``fanfold.DataParallel`` with ``device_ids=["cpu", "cpu"]`` against the bare module, finite differences or torch's
own documented behaviour as the oracle. Written anew from what each upstream test checks, named after it.

Upstream tests and where their semantics are checked:

- ported here: buffers_requiring_grad, rnn, lazy_linear, parallel_apply, parallel_apply_autocast,
  parallel_apply_passes_exception, multiple_input, model_no_refcycles, no_grad, sparse, nested_output,
  nested_input, module_zero_inputs, device_args, function_deletion, scatter_cpu, gather_cpu,
  gather_different_len_dicts, zero_grad, autocast, save_replica_module, strided_grad_layout,
  parameter_list_dict_replica, complex, TestDataParallelDeviceType (module, kwargs_only, kwargs_only_empty_*).
- already in test_data_parallel.py / test_replicate.py: data_parallel and small_back (outputs and gradients equal
  the bare module), model_device (parameters not on device_ids[0] are refused), replicate and replicate_buffers.
- not portable: scatter_gpu, gather_gpu (a second device type), and the device-order variants (0, 1) / (1, 0),
  which on CPU replicas are the same devices.
"""
import copy
import gc
import io
import traceback
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fanfold
from fanfold import DataParallel, data_parallel

CPU2 = ["cpu", "cpu"]


def _copy_pair(module: nn.Module) -> tuple[nn.Module, DataParallel]:
    return module, DataParallel(copy.deepcopy(module), CPU2)


def test_buffer_requiring_grad_gets_the_finite_difference_gradient():
    class Scaled(nn.Module):
        def __init__(self, t):
            super().__init__()
            self.register_buffer("t_rg", t)
            self.register_buffer("t_not_rg", t.clone().detach())

        def forward(self, x):
            return x * self.t_rg + self.t_not_rg

    torch.manual_seed(0)
    m = Scaled(torch.randn(7, dtype=torch.double, requires_grad=True))
    dpm = DataParallel(m, CPU2)
    x = torch.randn(4, 7, dtype=torch.double)
    assert torch.autograd.gradcheck(lambda t: dpm(x), (m.t_rg,), check_batched_grad=False)


def test_lstm_step_after_a_no_grad_forward_equals_the_bare_module():
    class BiLSTM(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(6, 5, 1, batch_first=True, bidirectional=True)

        def forward(self, x):
            self.rnn.flatten_parameters()
            return self.rnn(x)

    def step(model):
        opt = torch.optim.SGD(model.parameters(), lr=10)
        out = model(torch.ones(4, 3, 6))
        F.mse_loss(out[0], torch.zeros_like(out[0])).backward()
        opt.step()

    torch.manual_seed(0)
    with torch.no_grad():
        bare, dp = _copy_pair(BiLSTM())
        dp(torch.rand(2, 3, 6))  # a forward with grad disabled must not break the next training step
    step(bare)
    step(dp)
    for p, q in zip(bare.parameters(), dp.module.parameters(), strict=True):
        torch.testing.assert_close(q, p)


def test_lazy_module_is_refused_until_initialised():
    with pytest.raises(RuntimeError, match="uninitialized parameters"):
        DataParallel(nn.LazyLinear(3), CPU2)(torch.rand(4, 5))


def test_parallel_apply_takes_argument_tuples_or_single_arguments():
    torch.manual_seed(0)
    l1, l2 = nn.Linear(6, 3), nn.Linear(6, 3)
    i1, i2 = torch.randn(2, 6), torch.randn(2, 6)
    expected = (l1(i1), l2(i2))
    for inputs in [((i1,), (i2,)), (i1, i2)]:
        outputs = fanfold.parallel_apply((l1, l2), inputs, None)
        for out, exp in zip(outputs, expected, strict=True):
            torch.testing.assert_close(out, exp)


def test_autocast_reaches_the_replicas():
    torch.manual_seed(0)
    l1, l2 = nn.Linear(8, 4), nn.Linear(8, 4)
    i1, i2 = torch.randn(2, 8), torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = (l1(i1), l2(i2))
        outputs = fanfold.parallel_apply((l1, l2), (i1, i2), None)
        whole, expected_whole = DataParallel(l1, CPU2)(torch.cat([i1, i2])), l1(torch.cat([i1, i2]))
    for out, exp in zip(outputs, expected, strict=True):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, exp)
    assert whole.dtype == torch.bfloat16
    torch.testing.assert_close(whole, expected_whole)


def test_autocast_inside_forward():
    class Model(nn.Linear):
        @torch.autocast("cpu", dtype=torch.bfloat16)
        def forward(self, x):
            return super().forward(x)

    torch.manual_seed(0)
    bare, dp = _copy_pair(Model(8, 8))
    x = torch.randn(8, 8)
    out = dp(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, bare(x))


def test_exception_in_a_replica_keeps_its_type_and_names_the_replica():
    class Failing(nn.Module):
        def forward(self, *args):
            return {}["wonderful"]

    m = Failing()
    with pytest.raises(KeyError) as info:
        fanfold.parallel_apply((m, m), (None, None))
    assert "replica 0" in str(info.value) and "cpu" in str(info.value)
    assert "wonderful" in "".join(traceback.format_exception(info.value))  # the replica's own traceback


def test_several_inputs_a_python_float_and_kwargs():
    class Combine(nn.Module):
        def forward(self, var1, var2, float1, var3=None):
            return float1 * (var1 * var2 + (0 if var3 is None else var3))

    torch.manual_seed(0)
    var1, var2 = torch.randn(5, 5, requires_grad=True), torch.randn(5, 5, requires_grad=True)
    var3 = torch.randn(5, 5)
    float1 = 0.7
    m = Combine()

    def check(run, **kwargs):
        var1.grad = var2.grad = None
        expected = m(var1, var2, float1, **kwargs)
        g1, g2 = torch.autograd.grad(expected.sum(), (var1, var2))
        out = run()
        out.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(var1.grad, g1)
        torch.testing.assert_close(var2.grad, g2)

    for ids in (CPU2, ["cpu"]):
        check(lambda: data_parallel(m, (var1, var2, float1), ids))
        check(lambda: data_parallel(m, (var1, var2, float1), ids, module_kwargs={"var3": var3}), var3=var3)
        check(lambda: DataParallel(Combine(), ids)(var1, var2, float1, var3=var3), var3=var3)


def test_a_forward_leaves_no_reference_cycle():
    model = DataParallel(nn.Sequential(nn.Linear(1, 1)), CPU2)
    gc.collect()
    model(torch.randn(4, 1))
    assert gc.collect() == 0


def test_grad_mode_reaches_the_replicas():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            return x

    x = torch.randn(6, 3)
    with torch.no_grad():
        data_parallel(Probe(), x, CPU2)
    assert seen == [False, False]
    seen.clear()
    data_parallel(Probe(), x, CPU2)
    assert seen == [True, True]


def test_sparse_embedding_gradients_equal_the_bare_module():
    torch.manual_seed(0)
    bare, dp = _copy_pair(nn.Embedding(10, 5, sparse=True))
    idx = torch.randint(10, (20, 5))
    expected = bare(idx)
    expected.sum().backward()
    out = dp(idx)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    assert dp.module.weight.grad.is_sparse
    torch.testing.assert_close(dp.module.weight.grad.coalesce().to_dense(), bare.weight.grad.coalesce().to_dense())


def test_nested_output_keeps_its_structure_and_types():
    def fn(x):
        return [x, (x.sin(), x.cos(), [x.add(1)]), x, OrderedDict(a=x, b=[x.sin()])]

    class Net(nn.Module):
        def forward(self, x):
            return fn(x)

    x = torch.randn(4, 2)
    out, expected = data_parallel(Net(), x, CPU2), fn(x)
    assert type(out) is list and type(out[1]) is tuple and type(out[1][2]) is list
    assert isinstance(out[3], dict) and list(out[3]) == ["a", "b"] and type(out[3]["b"]) is list
    torch.testing.assert_close(out, expected)


def test_nested_input():
    class Net(nn.Module):
        def forward(self, *inputs):
            return inputs[1][0] * inputs[2]

    x = torch.randn(20, 3)
    inputs = (x.cos(), (x.sin(), x), x.exp())
    torch.testing.assert_close(data_parallel(Net(), inputs, CPU2), x.sin() * x.exp())


def test_module_without_inputs():
    class Constant(nn.Module):
        def forward(self):
            t = torch.eye(2, 3)
            return t + (1 - t)

    expected = torch.ones(2, 3)
    for out in (DataParallel(Constant(), ["cpu"])(), DataParallel(Constant(), CPU2)(),
                data_parallel(Constant(), None, ["cpu"]), data_parallel(Constant(), (), CPU2)):
        torch.testing.assert_close(out, expected)


def test_device_ids_and_output_device_as_torch_devices():
    torch.manual_seed(0)
    lin = nn.Linear(10, 5)
    x = torch.randn(20, 10, requires_grad=True)
    cpu = torch.device("cpu")
    for ids in (CPU2, [cpu, cpu]):
        out = data_parallel(lin, x, device_ids=ids, output_device=cpu)
        assert out.device == cpu
        torch.testing.assert_close(out, lin(x))


def _gradient_penalty(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return torch.autograd.grad(out, x, x.new_ones(out.size()), create_graph=True, retain_graph=True)[0].mean()


def _check_gradient_penalty(**dp_kwargs) -> None:
    torch.manual_seed(0)
    bare = nn.Linear(4, 1)
    dp = DataParallel(copy.deepcopy(bare), CPU2, **dp_kwargs)
    for m in (bare, dp):
        _gradient_penalty(m, torch.ones(2, 4, requires_grad=True)).backward()
    torch.testing.assert_close(dp.module.weight.grad, torch.full((1, 4), 0.25))
    # the penalty does not depend on the bias: the bare module leaves its gradient None (torch's DataParallel on
    # GPUs gives zeros, an artefact of its broadcast copies); fanfold follows the bare module
    assert bare.bias.grad is None and dp.module.bias.grad is None


def test_gradient_penalty_with_autograd_backward():
    _check_gradient_penalty(parallel_backward=False)


def test_gradient_penalty_by_default():
    _check_gradient_penalty()


def test_scatter_halves_and_its_gradient_and_double_gradient():
    x = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
    result = fanfold.scatter(x, CPU2)
    assert len(result) == 2
    torch.testing.assert_close(result[0], x[:2])
    torch.testing.assert_close(result[1], x[2:])
    grad = torch.full_like(result[0], 2.0)
    result[0].backward(grad)
    torch.testing.assert_close(x.grad[:2], grad)
    torch.testing.assert_close(x.grad[2:], torch.zeros_like(grad))
    fn = lambda y: fanfold.scatter(y, CPU2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), check_batched_grad=False)
    assert torch.autograd.gradgradcheck(fn, (x,), check_batched_grad=False)


def test_gather_concatenates_and_its_gradient_and_double_gradient():
    a, b = (torch.randn(2, 4, dtype=torch.double, requires_grad=True) for _ in range(2))
    result = fanfold.gather((a, b), "cpu")
    assert result.shape == (4, 4)
    torch.testing.assert_close(result, torch.cat([a, b]))
    grad = torch.randn(4, 4, dtype=torch.double)
    result.backward(grad)
    torch.testing.assert_close(a.grad, grad[:2])
    torch.testing.assert_close(b.grad, grad[2:])
    fn = lambda x, y: fanfold.gather((x, y), "cpu")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b), check_batched_grad=False)
    assert torch.autograd.gradgradcheck(fn, (a, b), check_batched_grad=False)


def test_gather_of_scalars_stacks_them():
    a, b = (torch.randn((), dtype=torch.double, requires_grad=True) for _ in range(2))
    with pytest.warns(UserWarning):
        result = fanfold.gather((a, b), "cpu")
    assert result.shape == (2,)
    torch.testing.assert_close(result, torch.stack([a, b]))
    grad = torch.randn(2, dtype=torch.double)
    result.backward(grad)
    torch.testing.assert_close(a.grad, grad[0])
    torch.testing.assert_close(b.grad, grad[1])


def test_gather_of_dicts_with_different_keys_is_refused():
    outputs = ({"a": torch.randn(1, 2)}, {"b": torch.randn(1, 2), "a": torch.randn(1, 2)})
    with pytest.raises(ValueError):
        fanfold.gather(outputs, "cpu")


def test_zero_grad_inside_a_replica_warns_and_keeps_the_gradients():
    class ZeroesInForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x, zero=False):
            if zero:
                self.zero_grad()
            return self.fc(x)

    model = ZeroesInForward()
    dp = DataParallel(model, CPU2)
    dp(torch.randn(4, 3)).sum().backward()
    before = model.fc.weight.grad.clone()
    with pytest.warns(UserWarning, match=r"Calling \.zero_grad\(\) from a module created with nn\.DataParallel\(\) "
                                         r"has no effect"):
        dp(torch.randn(4, 3), zero=True)
    assert torch.equal(model.fc.weight.grad, before)


@pytest.mark.parametrize("detach", [False, True])
def test_replicas_can_be_saved(detach):
    replicas = fanfold.replicate(nn.Linear(8, 8), CPU2, detach)
    buffer = io.BytesIO()
    torch.save(replicas, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for r, s in zip(replicas, loaded, strict=True):
        torch.testing.assert_close(s.weight, r.weight.detach())


@pytest.mark.parametrize("formats", [
    [torch.contiguous_format] * 4,
    [torch.channels_last] * 2 + [torch.contiguous_format] * 2,
    [torch.channels_last] * 4,
], ids=["contiguous", "mixed", "channels_last"])
def test_gradient_layout_follows_the_parameter_layout(formats):
    class ConvNet(nn.Module):
        def __init__(self):
            super().__init__()
            for i, (cin, cout) in enumerate([(4, 6), (6, 8), (8, 6), (6, 4)]):
                setattr(self, f"conv{i}", nn.Conv2d(cin, cout, 2).to(memory_format=formats[i]))

        def forward(self, x):
            for i in range(4):
                x = getattr(self, f"conv{i}")(x)
            return x

    torch.manual_seed(0)
    bare, dp = _copy_pair(ConvNet())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (bare, dp)]
    x, target = torch.randn(8, 4, 7, 7), torch.randn(8, 4, 3, 3)
    for _ in range(2):  # the first step creates the gradients, the second reuses the zeroed ones
        for m in (bare, dp):
            F.mse_loss(m(x), target).backward()
        for i, (mine, theirs) in enumerate(zip(dp.module.children(), bare.children(), strict=True)):
            assert mine.weight.grad.is_contiguous(memory_format=formats[i]), f"conv{i}"
            for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
        for opt in opts:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("container", ["list", "dict"])
def test_parameter_list_and_dict_reach_the_replicas(container):
    torch.manual_seed(0)
    p1, p2 = nn.Parameter(torch.rand(10)), nn.Parameter(torch.rand(10))
    keys = (0, 1) if container == "list" else ("0", "1")
    data = nn.ParameterList([p1, p2]) if container == "list" else nn.ParameterDict({"0": p1, "1": p2})
    seen = []

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.data = data

        def forward(self, x):
            a, b = self.data[keys[0]], self.data[keys[1]]
            seen.append((torch.equal(a, p1), torch.equal(b, p2), a.requires_grad, b.requires_grad))
            return x * a + b

    model = Holder()
    x = torch.randn(8, 10)
    expected = torch.autograd.grad((x * p1 + p2).pow(2).sum(), (p1, p2))
    DataParallel(model, CPU2)(x).pow(2).sum().backward()
    assert seen == [(True, True, True, True)] * 2
    torch.testing.assert_close(p1.grad, expected[0])
    torch.testing.assert_close(p2.grad, expected[1])


def test_complex_parameters():
    class ScaleComplex(nn.Module):
        def __init__(self):
            super().__init__()
            self.cplx = nn.Parameter(torch.randn(1, 10, dtype=torch.cfloat))

        def forward(self, x):
            return x * self.cplx

    torch.manual_seed(0)
    bare, dp = _copy_pair(ScaleComplex())
    x = torch.randn(6, 10, dtype=torch.cfloat)
    out, expected = dp(x), bare(x)
    torch.testing.assert_close(out, expected)
    out.abs().sum().backward()
    expected.abs().sum().backward()
    torch.testing.assert_close(dp.module.cplx.grad, bare.cplx.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("call", ["positional", "keyword", "empty_list", "empty_dict", "empty_tuple"])
def test_module_dtypes_and_keyword_only_inputs(dtype, call):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(10, 5).to(dtype)

        def forward(self, input):
            return self.lin(input["data"] if isinstance(input, dict) else input)

    torch.manual_seed(0)
    bare, dp = _copy_pair(Net())
    x = torch.randn(20, 10, dtype=dtype)
    empty = {"empty_list": [], "empty_dict": {}, "empty_tuple": ()}
    if call == "positional":
        out = dp(x)
    elif call == "keyword":
        out = dp(input=x)
    else:
        out = dp(input={"data": x, "unused": empty[call]})
    assert out.dtype == dtype
    torch.testing.assert_close(out, bare(x))
