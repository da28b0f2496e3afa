"""ZeRO stage 2 (``DistributedDataParallel.shard_gradients``) on 2 and 3 gloo ranks against one process training on
the whole batch with the plain torch optimizer (SGD with momentum, Adam, AdamW), 20 steps, with no_sync accumulation
and ``fanfold.clip_grad_norm_``; the torch transport (a true reduce-scatter) and the shm one; torch's own
reduce-scatter and all-gather; a comm hook written for torch's DDP; the bf16/fp16 comm hooks;
unused parameters; a checkpoint saved at 2 ranks and resumed at 3; memory held after backward, counted by walking
every tensor the reducer and the optimizer hold, against plain DDP + a plain optimizer.
"""

import pytest
import torch
import torch.distributed as dist
from test_zero_training import MAX_NORM, OPTS, SAVE_AT, STEPS, _data, _loss, _model, oracle

import fanfold
from fanfold.collectives.transport import TorchTransport
from fanfold.distributed import init_process_group

CAPS = dict(bucket_cap_mb=0.01, first_bucket_cap_mb=0.005)  # several buckets of the 5,768-element MLP


def _held(*roots, params=()):
    """Elements of every distinct tensor storage reachable from ``roots`` through fanfold objects, lists, tuples
    and dicts (meta tensors and the parameters' own storage excluded): what those objects keep alive."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen, storages, stack = set(), {}, list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and not isinstance(obj, torch.nn.Parameter):
                ptr = obj.untyped_storage().data_ptr()
                if ptr not in skip:
                    storages[ptr] = obj.untyped_storage().nbytes() // obj.element_size()
            if obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("fanfold") and hasattr(obj, "__dict__"):
            stack.extend(v for k, v in vars(obj).items()
                         if not k.endswith("transport") and k not in ("inspector", "optim"))
    return sum(storages.values())


def _state_elements(optim):
    return sum(t.numel() for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def _train(name, transport, hook=None, stage2=True, native=None, save=None, resume=None):
    model = _model()
    ddp = fanfold.DistributedDataParallel(model, transport=transport, **CAPS)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    cls, kw = OPTS[name]
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), cls, **kw) if stage2 else cls(model.parameters(), **kw)
    if stage2:
        ddp.shard_gradients(opt)
    if stage2 and native is not None:  # True: torch's reduce_scatter_tensor and all-gather, even on gloo
        t = ddp.reducer.transport
        getattr(t, "inner", t).native_scatter = native
    r, n, norms, grads = dist.get_rank(), dist.get_world_size(), [], 0
    start = fanfold.load(resume, {"model": ddp, "optimizer": opt})["step"] if resume else 0
    for step in range(start, STEPS):
        if save and step == SAVE_AT:
            fanfold.save(save, {"model": ddp, "optimizer": opt, "step": step})
        opt.zero_grad()
        with ddp.no_sync():
            _loss(ddp, *_data(step, 0, r, n)).backward()
        _loss(ddp, *_data(step, 1, r, n)).backward()
        if step == start + 1:  # after the backward: every gradient the model, the reducer and the optimizer hold
            grads = _held(ddp.reducer, opt, *model.parameters(), params=list(model.parameters()))
        clip = fanfold.clip_grad_norm_(opt, MAX_NORM) if stage2 else \
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append(float(clip))
        opt.step()
    inner = opt.optim if stage2 else opt
    buckets = [sum(model.get_parameter(ddp.reducer.names[i]).numel() for i in b) for b in ddp.reducer.buckets]
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms, "grads": grads,
            "state": _state_elements(inner), "pieces": len(getattr(opt, "_pieces", [])), "buckets": buckets,
            "all_grads_none": all(p.grad is None for p in model.parameters())}


class Sometimes(torch.nn.Module):
    """The MLP plus a head used on even steps only and one never used: unused parameters, the same on every rank."""

    def __init__(self):
        super().__init__()
        self.body = _model()
        torch.manual_seed(1)
        self.extra = torch.nn.Linear(8, 8).double()
        self.never = torch.nn.Linear(3, 3).double()

    def forward(self, x, step):
        h = self.body(x)
        return h + self.extra(h) if step % 2 == 0 else h


def _unused(stage2=True):
    """Adam over Sometimes, 6 steps; on a single process when stage2 is None. (parameters, state entries)"""
    model = Sometimes()
    distributed = stage2 is not None
    ddp = fanfold.DistributedDataParallel(model, find_unused_parameters=True, **CAPS) if distributed else model
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01) if distributed else \
        torch.optim.Adam(model.parameters(), lr=0.01)
    if distributed:
        ddp.shard_gradients(opt)
    r, n = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    for step in range(6):
        opt.zero_grad()
        x, y = _data(step, 0, r, n)
        ((ddp(x, step) - y) ** 2).mean().backward()
        opt.step()
    if distributed:
        opt.consolidate_state_dict(to=0)
    sd = opt.state_dict() if r == 0 else None
    return [p.detach().clone() for p in model.parameters()], None if sd is None else sorted(sd["state"])


def _ranks(plan, path):
    init_process_group(timeout=60)
    out = {key: _train(*args, **({"save": path} if key == "adam/torch" else
                                 {"resume": path} if key == "adam/resumed" else {})) for key, args in plan.items()}
    if dist.get_world_size() == 2:
        out["unused"] = _unused()
        out["native"] = _native_ops()
        out["errors"] = _errors()
    return out


def _native_ops():
    """torch's reduce-scatter (average) and all-gather of 10 elements through the transport stage 2 uses."""
    ops, r = TorchTransport(native_scatter=True), dist.get_rank()
    out, full = torch.empty(5, dtype=torch.float64), torch.empty(10, dtype=torch.float64)
    ops.reduce_scatter(torch.arange(10, dtype=torch.float64) * (r + 1), out, 0, divisor=2).wait()
    ops.all_gather(torch.full((5,), float(r + 7), dtype=torch.float64), full, 0).wait()
    return out, full


def _errors():
    model = _model()
    ddp = fanfold.DistributedDataParallel(model, transport="torch")
    out = []
    for make in (lambda: torch.optim.Adam(model.parameters()),
                 lambda: fanfold.ZeroRedundancyOptimizer(list(model.parameters())[:-1], torch.optim.Adam)):
        try:
            ddp.shard_gradients(make())
        except (TypeError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    view = fanfold.DistributedDataParallel(_model(), transport="torch", gradient_as_bucket_view=True)
    try:
        view.shard_gradients(fanfold.ZeroRedundancyOptimizer(view.module.parameters(), torch.optim.Adam))
    except ValueError as exc:
        out.append(f"ValueError: {exc}")
    ddp.shard_gradients(fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam))
    x, y = _data(0, 0, dist.get_rank(), dist.get_world_size())
    try:
        _loss(ddp, x, y).backward(create_graph=True)
    except RuntimeError as exc:
        out.append(f"RuntimeError: {exc}")
    return out


PLAN2 = {**{f"{name}/torch": (name, "torch") for name in OPTS}, "adam/plain": ("adam", "torch", None, False),
         "adam/shm/bf16": ("adam", "shm", fanfold.distributed.bf16_compress_hook),
         "adam/torch/fp16": ("adam", "torch", fanfold.distributed.fp16_compress_hook)}
def torch_style_hook(state, bucket):
    """A comm hook as written for torch's DDP: all-reduce the whole bucket, divide."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


PLAN2["adamw/native"] = ("adamw", "torch", None, True, True)
PLAN2["sgd/hook"] = ("sgd", "torch", torch_style_hook)
PLAN3 = {**{f"{name}/shm": (name, "shm") for name in OPTS}, "adam/resumed": ("adam", "shm")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zero2") / "adam.pt")


@pytest.fixture(scope="module")
def two_ranks(checkpoint):
    return fanfold.launch(_ranks, PLAN2, checkpoint, nprocs=2, timeout=300)


@pytest.fixture(scope="module")
def three_ranks(two_ranks, checkpoint):
    return fanfold.launch(_ranks, PLAN3, checkpoint, nprocs=3, timeout=300)


def _assert_params(got, want, rtol=1e-6, atol=1e-9):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(OPTS))
def test_stage2_no_sync_clipping_equal_single_process(two_ranks, three_ranks, world, name):
    results, key = (two_ranks, f"{name}/torch") if world == 2 else (three_ranks, f"{name}/shm")
    want, biggest = oracle(name)
    assert biggest > MAX_NORM  # clipping was active
    keys = [key, *{"adamw": ["adamw/native"], "sgd": ["sgd/hook"]}.get(name, [])] if world == 2 else [key]
    for res in results:
        for k in keys:
            _assert_params(res[k]["params"], want)
            assert res[k]["all_grads_none"]  # the full gradients are freed
    assert len({tuple(res[key]["norms"]) for res in results}) == 1


def test_torch_reduce_scatter_and_all_gather(two_ranks):
    for r, res in enumerate(two_ranks):
        out, full = res["native"]
        torch.testing.assert_close(out, torch.arange(10, dtype=torch.float64)[5 * r:5 * r + 5] * 1.5)
        torch.testing.assert_close(full, torch.tensor([7.0] * 5 + [8.0] * 5, dtype=torch.float64))


def test_shard_gradients_refuses_other_optimizers_and_settings(two_ranks):
    for res in two_ranks:
        plain, subset, view, graph = res["errors"]
        assert plain.startswith("TypeError") and "fanfold.ZeroRedundancyOptimizer" in plain
        assert subset.startswith("ValueError") and "exactly the DistributedDataParallel's trainable" in subset
        assert view.startswith("ValueError") and "gradient_as_bucket_view=True" in view
        assert graph.startswith("RuntimeError") and "create_graph=True) is not supported" in graph


@pytest.mark.parametrize("key", ["adam/shm/bf16", "adam/torch/fp16"])
def test_stage2_compression_hooks_track_single_process(two_ranks, key):
    want, _ = oracle("adam")
    for res in two_ranks:  # 3 (bf16) or 4-5 (fp16) significant digits per reduction, over 20 Adam steps
        _assert_params(res[key]["params"], want, rtol=0, atol=2e-2)
    for a, b in zip(two_ranks[0][key]["params"], two_ranks[1][key]["params"]):
        assert torch.equal(a, b)  # every rank holds the same model after the all-gather


@pytest.mark.parametrize("world", [2, 3])
def test_stage2_memory_after_backward(two_ranks, three_ranks, world):
    results, key = (two_ranks, "adam/torch") if world == 2 else (three_ranks, "adam/shm")
    total = sum(p.numel() for p in _model().parameters())
    for r, res in enumerate(results):
        bucket = max(res[key]["buckets"])
        # total/N + one bucket, plus the rounding of equal parts (< 1 element per bucket, and per rank in the
        # staging buffer): no .grad, no full bucket
        assert res[key]["grads"] <= total / world + bucket + len(res[key]["buckets"]) + world, (r, res[key])
        assert res[key]["state"] <= 2 * (total / world + bucket) + res[key]["pieces"], (r, res[key])
    if world == 2:  # the walk finds what plain DDP holds: every .grad and its buckets
        for res in results:
            assert res["adam/plain"]["grads"] >= 2 * total
            assert res["adam/plain"]["state"] >= 2 * total


def test_stage2_unused_parameters_as_single_process(two_ranks):
    want, want_state = _unused(stage2=None)
    for res in two_ranks:
        _assert_params(res["unused"][0], want)
    assert two_ranks[0]["unused"][1] == want_state  # the never-used parameters got no state, as in torch
    assert len(want_state) == len(want) - 2


def test_stage2_saved_at_two_ranks_resumes_at_three(three_ranks):
    want, _ = oracle("adam")  # the 2-rank run saved at step SAVE_AT; 3 ranks load it and train to the end
    for res in three_ranks:
        _assert_params(res["adam/resumed"]["params"], want)
