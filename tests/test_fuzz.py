"""Fuzzing with hypothesis: every input ends in the right result or a documented exception, never a crash or hang.

- scatter/gather over random nested structures (tuple, list, dict, namedtuple, dataclass), 10 dtypes, dims and batch
  sizes 0..64: scatter splits like ``split_sizes``, non-tensors are shared, gather(scatter(x)) == x. Batch 0 is a
  correct empty result (one replica gets the empty batch), not an error.
- DDP construction on 2 gloo ranks where rank 1's model is perturbed (a shape, a dtype, a name, an extra or a missing
  parameter, a frozen one, an extra buffer): both ranks raise the documented RuntimeError naming the parameter and
  the ranks, or, unperturbed, succeed with rank 0's parameters. A launch costs ~0.5 s, so each example is a list of
  models built one after the other in the same pair of workers.
"""
import collections
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fanfold
from fanfold._core.tree import first_difference, flatten
from fanfold.distributed import init_process_group
from fanfold.parallel.scatter_gather import gather, scatter, scatter_kwargs, split_sizes

# --- scatter / gather over random nested structures ----------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]
Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Batch:
    x: object
    meta: object


@st.composite
def _tensor(draw, batch, dim, min_ndim):
    ndim = draw(st.integers(min_ndim, 3))
    shape = [draw(st.integers(0, 3)) for _ in range(ndim)]
    shape[dim % ndim] = batch
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 50
    return values.to(dtype) if not dtype.is_complex else values.to(torch.float32).to(dtype)


@st.composite
def _case(draw):
    batch = draw(st.one_of(st.sampled_from([0, 1, 64]), st.integers(0, 64)))  # the edges more often
    min_ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-min_ndim, min_ndim - 1))
    tensor = _tensor(batch, dim, min_ndim)
    leaf = st.one_of(tensor, tensor, st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none()))
    tree = st.recursive(leaf, lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), kids, max_size=3),
        st.builds(Pair, kids, kids), st.builds(Batch, kids, kids),
    ), max_leaves=6)
    inputs = draw(st.one_of(tree, st.tuples(tensor, tree), st.builds(Batch, tree, tensor)))
    return inputs, dim, batch, draw(st.integers(1, 5))


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a is b or a == b


@settings(max_examples=150, deadline=None)
@given(_case())
def test_scatter_gather_round_trip(case):
    inputs, dim, batch, n = case
    leaves, spec = flatten(inputs)
    tensors = [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]
    parts = scatter(inputs, ["cpu"] * n, dim)
    # Batch 0 is a correct empty result, not an error: one replica gets the empty batch (split_sizes(0, n) == [0]).
    sizes = split_sizes(batch, n) if tensors else None
    assert len(parts) == (len(sizes) if tensors else n)
    for i, part in enumerate(parts):
        part_leaves, part_spec = flatten(part)
        assert first_difference(spec, part_spec) is None, f"replica {i} changed the structure"
        for (path, leaf), (_, got) in zip(leaves, part_leaves):
            if isinstance(leaf, torch.Tensor):
                assert _same(got, leaf.split(sizes, dim)[i]), f"replica {i}, {path}"
            else:
                assert got is leaf, f"replica {i}, {path}: a non-tensor leaf must be shared, not copied"
    back, back_spec = flatten(gather(parts, "cpu", dim))
    assert first_difference(spec, back_spec) is None
    for (path, leaf), (_, got) in zip(leaves, back):
        assert _same(got, leaf), path
    args, kwargs = scatter_kwargs((inputs,), {"extra": inputs}, ["cpu"] * n, dim)
    assert len(args) == len(kwargs) == len(parts)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 64), st.integers(1, 64), st.integers(1, 5), st.integers(0, 1))
def test_scatter_rejects_mismatched_batches_and_bad_dims(batch, other, n, dim):
    x = torch.zeros(batch, 2).movedim(0, dim)
    y = torch.zeros(batch + other, 2).movedim(0, dim)
    with pytest.raises(ValueError, match=rf"inputs\['y'\] has size {batch + other} along dim {dim} but "
                                         rf"inputs\['x'\] has {batch}"):
        scatter({"x": x, "y": y}, ["cpu"] * n, dim)
    with pytest.raises(ValueError, match=r"dim 2 is out of range for inputs\[0\] with shape"):
        scatter((x,), ["cpu"] * n, 2)
    with pytest.raises(ValueError, match="0-dim tensor cannot be split"):
        scatter((torch.tensor(1.0),), ["cpu"] * n, 0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 64), st.integers(1, 5), st.sampled_from([torch.float32, torch.float64]))
def test_scatter_gather_gradient_is_identity(batch, n, dtype):
    x = torch.randn(batch, 3, dtype=dtype, requires_grad=True)
    y = gather(scatter(x, ["cpu"] * n), "cpu")
    (y * torch.arange(y.numel(), dtype=dtype).view_as(y)).sum().backward()
    assert torch.equal(x.grad, torch.arange(x.numel(), dtype=dtype).view_as(x))

# --- DDP construction with perturbed models ------------------------------------------------------------------------

PERTURBATIONS = ["none", "shape", "dtype", "name", "extra", "missing", "frozen", "buffer"]


def _model(widths, dtype, perturb, layer):
    """A Linear stack; on the perturbed rank one thing about layer ``layer`` differs."""
    widths = list(widths)
    if perturb == "shape":
        widths[layer + 1] += 1
    layers = collections.OrderedDict()
    for i in range(len(widths) - 1):
        if perturb == "missing" and i == layer:
            continue
        name = f"renamed{i}" if perturb == "name" and i == layer else f"fc{i}"
        layers[name] = torch.nn.Linear(widths[i], widths[i + 1], dtype=dtype)
        if perturb == "dtype" and i == layer:
            layers[name] = layers[name].to(torch.float64 if dtype == torch.float32 else torch.float32)
        if perturb == "frozen" and i == layer:
            layers[name].weight.requires_grad_(False)
    model = torch.nn.Sequential(layers)
    if perturb == "extra":
        model.register_parameter("extra", torch.nn.Parameter(torch.zeros(widths[layer])))
    if perturb == "buffer":
        model.register_buffer("running", torch.zeros(widths[layer]))
    return model


def _construct_all(cases):
    init_process_group(timeout=30)
    rank = dist.get_rank()
    torch.manual_seed(rank)
    out = []
    for widths, dtype, perturb, layer in cases:
        model = _model(widths, dtype, perturb if rank == 1 else "none", layer)
        start = time.monotonic()
        try:
            fanfold.DistributedDataParallel(model)
            result = ("ok", [p.detach().clone() for p in model.parameters()])
        except (RuntimeError, ValueError, TypeError) as exc:
            result = (type(exc).__name__, str(exc))
        out.append((result, time.monotonic() - start))
    return out


_ddp_case = st.tuples(
    st.lists(st.integers(1, 6), min_size=2, max_size=5),
    st.sampled_from([torch.float32, torch.float64]),
    st.sampled_from(PERTURBATIONS),
    st.integers(0, 3),
).map(lambda c: (c[0], c[1], c[2], c[3] % (len(c[0]) - 1)))


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ddp_case, min_size=6, max_size=16))
def test_ddp_construction_with_perturbed_models(cases):
    results = fanfold.launch(_construct_all, cases, nprocs=2, timeout=120)
    for (widths, dtype, perturb, layer), (r0, t0), (r1, t1) in zip(cases, *results):
        assert max(t0, t1) < 10, f"construction took {max(t0, t1):.1f} s"
        if perturb == "none":
            assert r0[0] == r1[0] == "ok"
            assert all(torch.equal(a, b) for a, b in zip(r0[1], r1[1]))  # rank 0's parameters were broadcast
            continue
        for rank, (kind, msg) in enumerate((r0, r1)):
            assert kind == "RuntimeError", f"rank {rank}, perturbation {perturb}: {kind}: {msg}"
            assert "rank 0" in msg and "rank 1" in msg, msg
            name = {"extra": "'extra'", "buffer": "'running'"}.get(perturb, f"'fc{layer}.")
            assert name in msg, f"rank {rank}, perturbation {perturb} of {name}: {msg}"
