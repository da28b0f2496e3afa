"""scatter / scatter_kwargs / gather / split_sizes on CPU replicas; torch.chunk / torch.cat and plain autograd are the
oracle (exact equality: splitting and concatenating copy values without arithmetic)."""
import dataclasses
import math
from collections import namedtuple
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence, unpack_sequence

from fanfold import gather, scatter, scatter_kwargs
from fanfold._core.tree import flatten
from fanfold.parallel.scatter_gather import split_sizes

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Box:
    x: Any
    y: Any


def cpus(n):
    return ["cpu"] * n


def assert_same(a, b, path="x"):
    """Same structure, types and values; tensors equal; non-tensor leaves the very same objects."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, Box):
        assert_same(a.x, b.x, f"{path}.x")
        assert_same(a.y, b.y, f"{path}.y")
    else:
        assert a is b, path


# --- split_sizes -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("total,n,expected", [
    (30, 8, [4] * 7 + [2]), (10, 8, [2] * 5), (30, 2, [15, 15]), (10, 2, [5, 5]), (30, 3, [10, 10, 10]),
    (10, 3, [4, 4, 2]), (30, 1, [30]), (0, 4, [0]),
])
def test_split_sizes_tutorial(total, n, expected):
    assert split_sizes(total, n) == expected


def test_split_sizes_is_torch_chunk():
    for total in range(1, 41):
        for n in range(1, 9):
            assert split_sizes(total, n) == [c.numel() for c in torch.arange(total).chunk(n)], (total, n)


@pytest.mark.parametrize("total,weights,expected", [
    (40, [3, 1], [30, 10]), (10, [3, 1], [8, 2]), (1, [1, 3], [1]), (2, [1, 3], [1, 1]), (7, [1, 100, 1], [1, 5, 1]),
    (9, [1, 1, 1], [3, 3, 3]),
])
def test_split_sizes_weights(total, weights, expected):
    assert split_sizes(total, len(weights), weights) == expected


@given(total=st.integers(1, 200), weights=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=8))
@settings(deadline=None, max_examples=200)
def test_split_sizes_weights_properties(total, weights):
    sizes = split_sizes(total, len(weights), weights)
    assert sum(sizes) == total and len(sizes) == min(total, len(weights)) and min(sizes) >= 1
    quotas = [total * w / sum(weights) for w in weights]
    if all(q >= 1 for q in quotas):  # no replica needed topping up: plain largest-remainder rounding
        assert all(abs(s - q) < 1 for s, q in zip(sizes, quotas))


@pytest.mark.parametrize("args,match", [
    ((-1, 2), "total must be an int >= 0, got -1"), ((3, 0), r"n \(the number of devices\) must be an int >= 1"),
    ((3, 2, [1]), "weights has 1 entries for 2 devices"), ((3, 2, [1, 0]), "weights must be finite and > 0"),
    ((3, 2, [1, float("nan")]), "weights must be finite and > 0"), ((3.0, 2), "total must be an int"),
])
def test_split_sizes_errors(args, match):
    with pytest.raises(ValueError, match=match):
        split_sizes(*args)


# --- scatter / gather of tensors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_matches_chunk_and_gather_matches_cat(n, dim):
    x = torch.randn(6, 30, 5) if dim == 1 else torch.randn(30, 5, 6)
    parts = scatter(x, cpus(n), dim)
    expected = x.chunk(n, dim)
    assert len(parts) == len(expected)
    for p, e in zip(parts, expected):
        assert torch.equal(p, e)
    assert torch.equal(gather(parts, "cpu", dim), x)


def test_scatter_copies_so_replicas_may_write_in_place():
    x = torch.zeros(4, 2)
    a, b = scatter(x, cpus(2))
    a.add_(1)
    assert x.abs().sum() == 0 and b.abs().sum() == 0


def test_one_replica_on_the_callers_device_gets_the_callers_tensors():
    x, y = torch.randn(4, 2), torch.randn(4, 3)
    (args,), (kw,) = scatter_kwargs((x, 1), {"y": y}, ["cpu"])
    assert args[0] is x and kw["y"] is y
    assert gather([{"out": y}], "cpu")["out"] is y


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_gradient_through_scatter_and_gather_equals_plain_autograd(n):
    torch.manual_seed(0)
    x = torch.randn(30, 5, requires_grad=True)
    w = torch.randn(5, 2, requires_grad=True)
    y = torch.randn(30, 2)
    loss = ((x @ w).tanh() - y).pow(2).mean()
    gx, gw = torch.autograd.grad(loss, (x, w))

    xs, ys = scatter_kwargs((x,), {"target": y}, cpus(n))
    outs = [(xi @ w).tanh() - kw["target"] for (xi,), kw in zip(xs, ys)]
    loss_dp = gather(outs, "cpu").pow(2).mean()
    gx_dp, gw_dp = torch.autograd.grad(loss_dp, (x, w))
    torch.testing.assert_close(loss_dp, loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(gx_dp, gx, rtol=0, atol=1e-6)
    torch.testing.assert_close(gw_dp, gw, rtol=0, atol=1e-6)


def test_unused_replica_output_gives_zero_gradient():
    x = torch.randn(4, 3, requires_grad=True)
    parts = scatter(x, cpus(2))
    out = gather([{"y": p * 2, "z": p} for p in parts], "cpu")
    out["y"].sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_non_tensor_leaves_go_to_every_replica_by_reference():
    opts = torch.nn.ReLU()  # any object that is not a walked container
    inputs = (torch.arange(6), opts, None, 3.5, "s")
    for replica in scatter(inputs, cpus(3)):
        assert replica[1] is opts and replica[2] is None and replica[3] is inputs[3] and replica[4] is inputs[4]


def test_no_tensor_gives_every_device_a_replica():
    assert scatter((1, "a"), cpus(3)) == [(1, "a")] * 3


def test_gather_zero_dim_outputs_become_a_vector_with_a_warning():
    with pytest.warns(UserWarning, match=r"every replica returned a 0-dim tensor at output\['loss'\]"):
        out = gather([{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0)}], "cpu")
    assert torch.equal(out["loss"], torch.tensor([1.0, 2.0]))


def test_gather_target_minus_one_means_cpu():
    assert gather([torch.ones(1), torch.ones(2)], -1).device == torch.device("cpu")


def test_gather_keeps_equal_non_tensor_values():
    assert gather([(torch.ones(1), "same", None), (torch.ones(1), "same", None)], "cpu")[1:] == ("same", None)


# --- kwargs alignment with small batches (pytorch#15161, #52260) ----------------------------------------------------

@pytest.mark.parametrize("batch", [1, 2, 3, 7, 8, 9])
@pytest.mark.parametrize("where", ["both", "inputs", "kwargs"])
def test_scatter_kwargs_stay_aligned(batch, where):
    x = torch.arange(batch)
    inputs = (x, "tag") if where != "kwargs" else ("tag",)
    kwargs = {"mask": x * 10, "flag": True} if where != "inputs" else {"flag": True}
    ins, kws = scatter_kwargs(inputs, kwargs, cpus(8))
    n = len(x.chunk(8))
    assert len(ins) == len(kws) == n
    for i, (args, kw) in enumerate(zip(ins, kws)):
        assert kw["flag"] is True and args[-1] == "tag"
        rows = x.chunk(8)[i]
        if where != "kwargs":
            assert torch.equal(args[0], rows)
        if where != "inputs":
            assert torch.equal(kw["mask"], rows * 10)


def test_scatter_kwargs_accepts_none_and_a_bare_tensor():
    ins, kws = scatter_kwargs(torch.arange(4), None, cpus(2))
    assert [a[0].tolist() for a in ins] == [[0, 1], [2, 3]] and kws == ({}, {})


# --- chunk_sizes and weights --------------------------------------------------------------------------------------

def test_chunk_sizes_and_weights():
    x = torch.arange(40)
    assert [p.numel() for p in scatter(x, cpus(3), chunk_sizes=[5, 0, 35])] == [5, 0, 35]
    assert [p.numel() for p in scatter(x, cpus(3), chunk_sizes=[40])] == [40]
    ins, kws = scatter_kwargs((x,), {"m": x}, cpus(2), weights=[3, 1])
    assert [a[0].numel() for a in ins] == [30, 10] and torch.equal(kws[1]["m"], x[30:])


@pytest.mark.parametrize("kwargs,match", [
    ({"chunk_sizes": [10, 20]}, r"chunk_sizes \[10, 20\] sum to 30, but the batch size is 40 \(inputs along dim 0\)"),
    ({"chunk_sizes": [50, -10]}, r"chunk_sizes must be ints >= 0, got \[50, -10\]"),
    ({"chunk_sizes": [10, 10, 10, 10]}, "4 chunk_sizes for 3 devices"),
    ({"chunk_sizes": []}, "0 chunk_sizes for 3 devices"),
    ({"chunk_sizes": [20.0, 20]}, "chunk_sizes must be ints"),
    ({"chunk_sizes": [20, 20], "weights": [1, 1, 1]}, "chunk_sizes or weights, not both"),
])
def test_bad_chunk_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scatter(torch.arange(40), cpus(3), **kwargs)


# --- PackedSequence -------------------------------------------------------------------------------------------------

def _sequences(requires_grad=False):
    torch.manual_seed(0)
    return [torch.randn(n, 3, requires_grad=requires_grad) for n in (4, 6, 1, 5, 6, 2, 3)]


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_packed_sequence_is_split_by_sequences(n, enforce_sorted):
    seqs = _sequences()
    if enforce_sorted:
        seqs.sort(key=len, reverse=True)
    packed = pack_sequence(seqs, enforce_sorted=enforce_sorted)
    parts = scatter((packed, torch.arange(7)), cpus(n))
    start = 0
    for p, rows in parts:
        assert isinstance(p, PackedSequence)
        mine = unpack_sequence(p)
        assert len(mine) == rows.numel()
        for s, r in zip(mine, rows.tolist()):
            assert torch.equal(s, seqs[r])
        start += len(mine)
    assert start == 7
    back = gather([p for p, _ in parts], "cpu")
    for a, b in zip(unpack_sequence(back), seqs):
        assert torch.equal(a, b)


def test_packed_sequence_gradient_equals_plain_autograd():
    seqs = _sequences(requires_grad=True)
    weights = torch.arange(1.0, 4.0)

    def loss_of(packed):
        padded, lengths = pad_packed_sequence(packed, batch_first=True)
        return (padded * weights).pow(2).sum() + lengths.sum()

    direct = torch.autograd.grad(loss_of(pack_sequence(seqs, enforce_sorted=False)), seqs)
    parts = scatter(pack_sequence(seqs, enforce_sorted=False), cpus(3))
    outs = [PackedSequence(p.data * 1.0, p.batch_sizes, p.sorted_indices, p.unsorted_indices) for p in parts]
    through = torch.autograd.grad(loss_of(gather(outs, "cpu")), seqs)
    for a, b in zip(through, direct):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_packed_sequence_cannot_get_an_empty_chunk():
    packed = pack_sequence(_sequences(), enforce_sorted=False)
    with pytest.raises(ValueError, match=r"give a replica no sequence of inputs\[0\]"):
        scatter((packed,), cpus(2), chunk_sizes=[7, 0])


# --- errors -------------------------------------------------------------------------------------------------------

def test_error_sizes_disagree_names_path_and_sizes():
    with pytest.raises(ValueError, match=r"inputs\[1\]\['mask'\] has size 7 along dim 0 but inputs\[0\] has 8"):
        scatter((torch.zeros(8, 2), {"mask": torch.zeros(7)}), cpus(2))
    packed = pack_sequence(_sequences(), enforce_sorted=False)
    with pytest.raises(ValueError, match=r"kwargs\['lengths'\] has size 6 along dim 0 but inputs\[0\] has 7"):
        scatter_kwargs((packed,), {"lengths": torch.zeros(6)}, cpus(2))


def test_error_dim_out_of_range_names_dim_shape_and_path():
    with pytest.raises(ValueError, match=r"dim 2 is out of range for inputs\.b with shape \(4, 3\)"):
        scatter(Pair(torch.zeros(4, 3, 2), torch.zeros(4, 3)), cpus(2), dim=2)
    with pytest.raises(ValueError, match=r"dim 0 is out of range for kwargs\['t'\] with shape \(\).*0-dim tensor"):
        scatter_kwargs((), {"t": torch.tensor(1.0)}, cpus(2))
    with pytest.raises(TypeError, match="dim must be an int, got str"):
        scatter(torch.zeros(2), cpus(2), dim="0")


def test_error_empty_devices():
    with pytest.raises(ValueError, match="target_gpus is empty"):
        scatter(torch.zeros(2), [])
    with pytest.raises(ValueError, match="target_gpus is empty"):
        scatter_kwargs((torch.zeros(2),), {}, [])


@pytest.mark.parametrize("outputs,match", [
    ([{"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)}],
     r"replica 1 returned a different structure than replica 0 at output: a dict with keys \['a'\] vs a dict with "
     r"keys \['a', 'b'\]"),
    ([(torch.ones(1), [torch.ones(1)]), (torch.ones(1), (torch.ones(1),))],
     r"replica 1 .* at output\[1\]: a list with length 1 vs a tuple with length 1"),
    ([Box(torch.ones(1), 1), Box(torch.ones(1), 1), Box(torch.ones(1), None)],
     r"replicas returned different values at output\.y: 1 \(replica 0\) vs None \(replica 2\)"),
    ([Pair(torch.ones(1), 2), Pair(torch.ones(1), torch.ones(1))],
     r"replica 1 returned tensor at output\.b, replica 0 returned int"),
    ([torch.ones(2, 3), torch.ones(2, 4)], r"replica 1 returned shape \(2, 4\) at output, replica 0 returned \(2, 3\)"),
    ([torch.ones(2), torch.ones(2)], r"gather: dim 1 is out of range for output with shape \(2,\) \(replica 0\)"),
    ([], "outputs is empty"),
])
def test_gather_errors(outputs, match):
    with pytest.raises(ValueError, match=match):
        gather(outputs, "cpu", dim=1 if "dim 1" in match else 0)


# --- property: scatter then gather returns the input ----------------------------------------------------------------

def _structures(batch, dim):
    def tensor(trailing):
        shape = [2] * dim + [batch] + [2] * trailing
        return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)

    leaves = st.one_of(
        st.integers(0, 2).map(tensor), st.integers(), st.text(max_size=2), st.none(), st.booleans()
    )

    def containers(children):
        return st.one_of(
            st.tuples(children, children), st.lists(children, max_size=3),
            st.dictionaries(st.sampled_from("abc"), children, max_size=3),
            st.builds(Pair, children, children), st.builds(Box, children, children),
        )

    return st.recursive(leaves, containers, max_leaves=8)


@given(data=st.data(), batch=st.integers(1, 40), n=st.integers(1, 8), dim=st.integers(0, 2))
@settings(deadline=None, max_examples=150)
def test_property_scatter_then_gather_is_identity(data, batch, n, dim):
    inputs = data.draw(_structures(batch, dim))
    parts = scatter(inputs, cpus(n), dim)
    has_tensor = any(isinstance(leaf, torch.Tensor) for _, leaf in flatten(inputs)[0])
    assert len(parts) == (len(torch.empty(batch).chunk(n)) if has_tensor else n)
    assert_same(gather(parts, "cpu", dim), inputs)
