"""Differential tests (issue 24): ``fanfold.DataParallel`` (thread and process engines) against the bare module.

hypothesis draws the arguments of a forward: 1-3 positional and 0-2 keyword arguments, each a tree of tuples, lists,
dicts and dataclasses over float tensors (that may require grad), integer tensors, numbers and strings; the batch
size (0-13, so uneven splits and batches smaller than the replicas), 2 or 3 CPU replicas, the engine, the thread
engine's ``parallel_backward``, explicit ``chunk_sizes``, float64 or float32, train or eval mode, BatchNorm or not,
the output's structure (tensor, tuple, dict with a list and an integer tensor, dataclass), and the backward: a plain
one (1 or 2 forwards, gradients accumulated), or a double backward (a penalty on the gradient of the loss with respect
to the parameters or to the inputs, ``create_graph=True``). The module (``Zoo``) combines whatever tensors it gets,
so layers that received nothing get no gradient (``None`` must stay ``None``).

Compared: outputs, parameter and input gradients (float64: rtol 1e-10; float32: rtol 1e-5) and buffers, or both
raise. The documented deviations have their own oracle (docs/data-parallel.md): BatchNorm in training mode
normalises each replica's chunk, so the bare module runs chunk by chunk, and its running statistics come from the
first chunk only; the process engine refuses a double backward with a RuntimeError that points to engine="thread".

The process engine's workers are started once per replica count (a module-scoped fixture) and reused: the draws
load their weights in place, which needs no restart. Budget: ``FANFOLD_FUZZ_EXAMPLES=N`` draws N configurations per
test; unset, a bounded run for ``make test``. Seeds are fixed (``derandomize``), no example database is written.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields, is_dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fanfold

from .trees import cat_tree, map_tree

FUZZ = int(os.environ.get("FANFOLD_FUZZ_EXAMPLES", "0") or 0)
F, H, VOCAB = 4, 6, 7

SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def budget(bounded: int) -> int:
    return FUZZ or bounded


@dataclass
class Pack:
    """A dataclass argument (scattered field by field)."""

    a: object
    b: object


@dataclass
class Out:
    y: torch.Tensor
    hidden: torch.Tensor


def leaves(obj) -> list:
    """Every leaf of nested tuples, lists, dicts and dataclasses, in order."""
    if isinstance(obj, (tuple, list)):
        return [x for o in obj for x in leaves(o)]
    if isinstance(obj, dict):
        return [x for o in obj.values() for x in leaves(o)]
    if is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in fields(obj) for x in leaves(getattr(obj, f.name))]
    return [obj]


class Zoo(nn.Module):
    """Combines every tensor it is given: float ones through ``fx`` / ``fy`` in turn, integer ones through an
    embedding, numbers as a scale; ``plan`` says whether BatchNorm runs and what structure comes out."""

    def __init__(self):
        super().__init__()
        self.fx, self.fy = nn.Linear(F, H), nn.Linear(F, H)
        self.emb = nn.Embedding(VOCAB, H)
        self.bn = nn.BatchNorm1d(H)
        self.out = nn.Linear(H, F)

    def forward(self, *args, plan=("tensor",), **kwargs):
        h, scale, floats = None, 1.0, 0
        for leaf in leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                if leaf.is_floating_point():
                    part = (self.fx if floats % 2 == 0 else self.fy)(leaf)
                    floats += 1
                else:
                    part = self.emb(leaf)
                h = part if h is None else h + part
            elif isinstance(leaf, float):
                scale *= leaf
        if "bn" in plan:
            h = self.bn(h)
        h = torch.tanh(h) * scale
        y = self.out(h)
        kind = plan[0]
        if kind == "tuple":
            return y, h
        if kind == "dict":
            return {"y": y, "rest": [h, h.argmax(1)]}
        if kind == "dataclass":
            return Out(y, h)
        return y


def zoo(seed: int, dtype: torch.dtype) -> Zoo:
    torch.manual_seed(seed)
    return Zoo().to(dtype)


@dataclass(frozen=True)
class Draw:
    args: tuple  # trees of leaf codes: "f" float tensor, "i" integer tensor, 0.5 / 2.0 numbers, "s" strings
    kwargs: dict
    rows: int
    replicas: int
    engine: str
    parallel_backward: bool
    chunk_sizes: tuple | None
    dtype: torch.dtype
    train: bool
    plan: tuple
    input_grad: bool
    backward: str  # "plain", "twice" (two forwards, gradients accumulated), "double_params", "double_inputs"
    seed: int

    @property
    def double(self) -> bool:
        return self.backward.startswith("double")


def materialise(tree, rows: int, dtype: torch.dtype, g: torch.Generator, grad: bool):
    """Leaf codes -> values: the same call gives the same tensors (the generator is seeded per draw)."""
    if isinstance(tree, tuple) and tree and tree[0] == "pack":
        return Pack(materialise(tree[1], rows, dtype, g, grad), materialise(tree[2], rows, dtype, g, grad))
    if isinstance(tree, (tuple, list)):
        return type(tree)(materialise(t, rows, dtype, g, grad) for t in tree)
    if isinstance(tree, dict):
        return {k: materialise(v, rows, dtype, g, grad) for k, v in tree.items()}
    if tree == "f":
        return torch.randn(rows, F, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
    if tree == "i":
        return torch.randint(VOCAB, (rows,), generator=g)
    if tree == "s":
        return "label"
    return tree


def arguments(d: Draw):
    g = torch.Generator().manual_seed(d.seed + 1)
    args = tuple(materialise(t, d.rows, d.dtype, g, d.input_grad) for t in d.args)
    kwargs = {k: materialise(t, d.rows, d.dtype, g, d.input_grad) for k, t in d.kwargs.items()}
    return args, {**kwargs, "plan": d.plan}


def loss_of(out) -> torch.Tensor:
    return sum((t ** 2).mean() + t.sum() / 7 for t in leaves(out) if isinstance(t, torch.Tensor)
               and t.is_floating_point())


def _inputs(args, kwargs) -> list[torch.Tensor]:
    return [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]


def _state(module: nn.Module, args, kwargs) -> dict:
    return {"grads": {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()},
            "input_grads": [None if t.grad is None else t.grad.clone() for t in _inputs(args, kwargs)],
            "buffers": {n: b.clone() for n, b in module.named_buffers()}}


def backward(run, d: Draw, params: list[nn.Parameter], args, kwargs) -> dict:
    """One step of ``d.backward`` through ``run`` (the wrapper, or the bare module by chunks)."""
    out = run(args, kwargs)
    loss = loss_of(out)
    if d.backward == "plain":
        loss.backward()
    elif d.backward == "twice":
        loss.backward()
        again = loss_of(run(args, kwargs))
        again.backward()
        loss = loss + again
    else:
        wrt = params if d.backward == "double_params" else _inputs(args, kwargs)
        grads = torch.autograd.grad(loss, wrt, create_graph=True, allow_unused=True)
        penalty = sum((g ** 2).sum() for g in grads if g is not None)
        penalty.backward()
    return {"output": map_tree(out, torch.Tensor.detach), "loss": loss.detach()}


def chunk_sizes_of(d: Draw) -> list[int]:
    """How the batch is split (the oracle's own rule: torch.chunk's, or the explicit sizes)."""
    if d.chunk_sizes is not None:
        return list(d.chunk_sizes)
    return [0] if d.rows == 0 else [len(c) for c in torch.chunk(torch.arange(d.rows), d.replicas)]


def bare_by_chunks(module: nn.Module, d: Draw):
    """The bare module as DataParallel with BatchNorm in training mode must equal: each chunk normalised alone, the
    running statistics updated from the first chunk only (the other chunks run on copies of the buffers)."""
    sizes = chunk_sizes_of(d)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def run(args, kwargs):
        outs = []
        for i, (a, n) in enumerate(zip(starts, sizes)):
            part_args, part_kwargs = map_tree((args, kwargs), lambda t, a=a, n=n: t[a:a + n])
            if i == 0:
                outs.append(module(*part_args, **part_kwargs))
            else:
                state = {**dict(module.named_parameters()), **{k: b.clone() for k, b in module.named_buffers()}}
                outs.append(functional_call(module, state, part_args, part_kwargs))
        return cat_tree(outs)
    return run


def oracle(d: Draw) -> dict | tuple:
    module = zoo(d.seed, d.dtype).train(d.train)
    args, kwargs = arguments(d)
    batchnorm_chunks = d.train and "bn" in d.plan
    run = bare_by_chunks(module, d) if batchnorm_chunks else (lambda a, k: module(*a, **k))
    try:
        res = backward(run, d, list(module.parameters()), args, kwargs)
    except Exception as exc:  # noqa: BLE001 (both must raise)
        return ("raised", type(exc).__name__, str(exc)[:300])
    return {**res, **_state(module, args, kwargs)}


def through_data_parallel(d: Draw, dp: fanfold.DataParallel) -> dict | tuple:
    args, kwargs = arguments(d)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the double backward's announcement; gathering 0-dim outputs
            res = backward(lambda a, k: dp(*a, **k), d, list(dp.module.parameters()), args, kwargs)
    except Exception as exc:  # noqa: BLE001
        return ("raised", type(exc).__name__, str(exc)[:300])
    return {**res, **_state(dp.module, args, kwargs)}


def _close(got, want, d: Draw, what: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{what}: keys {list(got)} vs {list(want)}"
        for k in want:
            _close(got[k], want[k], d, f"{what}[{k!r}]")
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want), f"{what}: {type(got)} vs {type(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a, b, d, f"{what}[{i}]")
    elif is_dataclass(want):
        assert type(got) is type(want), f"{what}: {type(got).__name__} vs {type(want).__name__}"
        for f in fields(want):
            _close(getattr(got, f.name), getattr(want, f.name), d, f"{what}.{f.name}")
    elif want is None:
        assert got is None, f"{what}: a gradient where the bare module has none: {got}"
    else:
        assert isinstance(got, torch.Tensor), f"{what}: {got!r} where the bare module gives a tensor"
        assert got.shape == want.shape and got.dtype == want.dtype, \
            f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
        if not want.is_floating_point():
            assert torch.equal(got, want), f"{what}: {got} vs {want}"
            return
        f64 = want.dtype == torch.float64
        scale = max(1.0, want.abs().nan_to_num().max().item()) if want.numel() else 1.0
        torch.testing.assert_close(got, want, rtol=1e-10 if f64 else 1e-5, atol=(1e-12 if f64 else 1e-6) * scale,
                                   equal_nan=True, msg=lambda m: f"{what}: {m}")


def compare(d: Draw, dp: fanfold.DataParallel) -> None:
    want = oracle(d)
    got = through_data_parallel(d, dp)
    if d.engine == "process" and d.double and not isinstance(want, tuple):
        # documented (docs/data-parallel.md, Limits): refused, pointing to the thread engine
        assert isinstance(got, tuple) and got[1] == "RuntimeError" and "engine='thread'" in got[2], got
        return
    if isinstance(want, tuple) or isinstance(got, tuple):
        assert isinstance(got, tuple) and isinstance(want, tuple), f"one side raised: {got!r} vs {want!r}"
        assert got[1] == want[1], f"raised {got[1]} where the bare module raised {want[1]}: {got[2]} / {want[2]}"
        return
    for key in want:
        _close(got[key], want[key], d, key)


# ---- strategies ---------------------------------------------------------------------------------------------------
def trees(max_leaves: int = 4):
    leaf = st.sampled_from(["f", "f", "i", 0.5, 2.0, "s"])
    return st.recursive(leaf, lambda kids: st.one_of(
        st.lists(kids, min_size=1, max_size=3), st.lists(kids, min_size=1, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), kids, min_size=1, max_size=3),
        st.tuples(st.just("pack"), kids, kids)), max_leaves=max_leaves)


def _codes(tree) -> list:
    if isinstance(tree, tuple) and tree and tree[0] == "pack":
        return _codes(tree[1]) + _codes(tree[2])
    if isinstance(tree, (tuple, list)):
        return [c for t in tree for c in _codes(t)]
    if isinstance(tree, dict):
        return [c for t in tree.values() for c in _codes(t)]
    return [tree]


@st.composite
def draws(draw, engine: str | None = None) -> Draw:
    engine = engine or draw(st.sampled_from(["thread", "process"]))
    args = tuple(draw(st.lists(trees(), min_size=1, max_size=3)))
    kwargs = draw(st.dictionaries(st.sampled_from(["k0", "k1"]), trees(), max_size=2))
    if "f" not in _codes((args, list(kwargs.values()))):  # the module needs a float tensor to start from
        args = ("f", *args)
    rows = draw(st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(0, 13)))
    replicas = draw(st.sampled_from([2, 3]))
    chunk_sizes = None
    if rows and draw(st.integers(0, 3)) == 0:  # explicit sizes: positive, summing to the batch
        n = min(replicas, rows)
        cuts = sorted(draw(st.lists(st.integers(1, rows - 1), min_size=n - 1, max_size=n - 1, unique=True))) \
            if rows > 1 else []
        edges = [0, *cuts, rows]
        chunk_sizes = tuple(b - a for a, b in zip(edges, edges[1:]))
    plan = (draw(st.sampled_from(["tensor", "tuple", "dict", "dataclass"])),
            *(("bn",) if draw(st.booleans()) else ()))
    input_grad = draw(st.booleans())
    backward = draw(st.sampled_from(["plain", "plain", "twice", "double_params"]
                                    + (["double_inputs"] if input_grad else [])))
    return Draw(args=args, kwargs=kwargs, rows=rows, replicas=replicas, engine=engine,
                parallel_backward=engine == "process" or draw(st.booleans()), chunk_sizes=chunk_sizes,
                dtype=torch.float64 if engine == "process" else draw(st.sampled_from([torch.float64, torch.float32])),
                train=draw(st.booleans()), plan=plan, input_grad=input_grad, backward=backward,
                seed=draw(st.integers(0, 2**16)))


# ---- the tests ----------------------------------------------------------------------------------------------------
def check_thread(d: Draw) -> None:
    dp = fanfold.DataParallel(zoo(d.seed, d.dtype).train(d.train), ["cpu"] * d.replicas,
                              chunk_sizes=list(d.chunk_sizes) if d.chunk_sizes else None,
                              parallel_backward=d.parallel_backward)
    try:
        compare(d, dp)
    finally:
        dp.close()


@settings(max_examples=budget(150), **SETTINGS)
@given(draws(engine="thread"))
def test_thread_engine_equals_the_bare_module(d):
    check_thread(d)


@pytest.fixture(scope="module")
def process_engines():
    """One process-engine DataParallel per replica count, started on first use and reused by every draw."""
    engines: dict[int, fanfold.DataParallel] = {}

    def get(replicas: int) -> fanfold.DataParallel:
        if replicas not in engines:
            engines[replicas] = fanfold.DataParallel(zoo(0, torch.float64), ["cpu"] * replicas, engine="process")
        return engines[replicas]

    yield get
    for dp in engines.values():
        dp.close()


def check_process(d: Draw, engines) -> None:
    dp = engines(d.replicas)
    fresh = zoo(d.seed, d.dtype)
    dp.module.load_state_dict(fresh.state_dict())  # in place: the workers see it without a restart
    dp.module.zero_grad(set_to_none=True)
    dp.train(d.train)
    dp.chunk_sizes = list(d.chunk_sizes) if d.chunk_sizes else None
    compare(d, dp)


@pytest.mark.timeout(300 + 2 * FUZZ)
@settings(max_examples=budget(40), **SETTINGS)
@given(draws(engine="process"))
def test_process_engine_equals_the_bare_module(process_engines, d):
    check_process(d, process_engines)


REGRESSIONS = [  # every failing example found, kept
    # a dataclass output through the process engine: the output's spec kept the instance itself as its template,
    # so sending the spec pickled the replica's graph tensors ("Cowardly refusing to serialize non-leaf tensor");
    # fixed in _core/tree.py (the template is an empty copy)
    Draw(args=("f",), kwargs={}, rows=2, replicas=2, engine="process", parallel_backward=True, chunk_sizes=None,
         dtype=torch.float64, train=False, plan=("dataclass",), input_grad=False, backward="plain", seed=0),
]


@pytest.mark.parametrize("d", REGRESSIONS, ids=str)
def test_data_parallel_regressions(d, process_engines):
    check_process(d, process_engines) if d.engine == "process" else check_thread(d)
