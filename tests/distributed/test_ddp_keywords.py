"""Every keyword of torch's DistributedDataParallel (2.13) has torch's meaning in fanfold's, or is refused naming it:
the signature, buffers synced before every training forward (the first included), static_graph, mixed_precision,
skip_all_reduce_unused_params, bucket_cap_mb_list, batched_grad_copy, device_mesh, delay_all_reduce_named_params
and join's early-termination error -- each against torch's DDP over gloo in the same ranks, or a one-process oracle."""
import functools
import inspect
import warnings

import pytest
import torch
from torch import nn

import fanfold
from _conformance import (
    IMPLS,
    Checkpointed,
    Recording,
    Scaled,
    branchy_steps,
    close,
    data,
    grads,
    oracle,
    sgd,
    shard,
    train,
    wrap,
)
from fanfold.distributed import init_process_group, rank, world_size


def test_signature_is_torchs():
    theirs = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    ours = inspect.signature(fanfold.DDP).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, p in theirs.items():
        assert ours[name].default == p.default, name


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(process_group=object(), device_mesh=object()), RuntimeError, "both process_group and device_mesh"),
    (dict(delay_all_reduce_named_params=[]), ValueError, "need to be set at the same time"),
    (dict(static_graph="yes"), TypeError, "static_graph must be True or False"),
    (dict(bucket_cap_mb_list=[]), ValueError, "bucket_cap_mb_list must be a non-empty list"),
    (dict(bucket_cap_mb_list=[1], first_bucket_cap_mb=1), ValueError, "give one"),
])
def test_bad_keywords_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        fanfold.DDP(nn.Linear(2, 2), **kwargs)


def _buffers_and_join():
    init_process_group(timeout=60)
    r, n = rank(), world_size()
    x = shard(data(0)[0], r, n)
    out = {}
    for impl in IMPLS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for kw in ({}, {"broadcast_buffers": False}, {"forward_sync_buffers": False}):
                model = Scaled()
                model.scale.fill_(r + 1.0)  # different on each rank before wrapping
                ddp = wrap(impl, model, **kw)
                seen = [model.scale.clone()]  # after construction
                model.scale.mul_(r + 2.0)  # and changed again between construction and the first forward
                ddp(x).sum().backward()
                seen.append(model.scale.clone())
                with torch.no_grad():
                    ddp(x)  # a forward without grad: the next one does not sync (torch's rule)
                model.scale.add_(r)
                ddp(x)
                seen.append(model.scale.clone())
                ddp(x).sum().backward()  # synced again: the previous forward was a training one
                seen.append(model.scale.clone())
                out[impl, str(kw)] = seen
        model = Scaled()  # GANs: two forwards, one backward; the second forward's sync must not break the first's
        model.scale.fill_(r + 1.0)
        ddp = wrap(impl, model, init_sync=False)
        (ddp(x).sum() + ddp(2 * x).sum()).backward()
        out[impl, "gan"] = grads(model)
        model = nn.Linear(8, 1)
        ddp = wrap(impl, model)
        try:
            with ddp.join(throw_on_early_termination=True):
                for _ in range(3 if r == 0 else 1):
                    ddp(x).sum().backward()
            out[impl, "join"] = None
        except RuntimeError as exc:
            out[impl, "join"] = str(exc)
    return out


def test_buffers_sync_like_torch_and_join_raises_with_torchs_words():
    r0, r1 = fanfold.launch(_buffers_and_join, nprocs=2, timeout=280)
    for res in (r0, r1):
        for key in [k for k in res if k[0] == "torch" and k[1] != "join"]:
            for impl in IMPLS[1:]:
                got, theirs = res[(impl,) + key[1:]], res[key]
                same = close(got, theirs) if isinstance(got, dict) else all(map(torch.equal, got, theirs))
                assert same, (impl, key, got, theirs)
    # the cases themselves: the first forward syncs from rank 0 (torch 2.13: forward_sync_buffers)
    assert torch.equal(r1["fanfold/shm", "{}"][1], torch.full((4,), 2.0))
    assert torch.equal(r1["fanfold/shm", "{'broadcast_buffers': False}"][0], torch.full((4,), 2.0))  # rank-local
    assert torch.equal(r1["fanfold/shm", "{'forward_sync_buffers': False}"][0], torch.ones(4))  # init sync only
    for impl in IMPLS:
        assert "Detected at least one rank that exhausted inputs. Throwing across all ranks." in r0[impl, "join"]
        assert "Rank 1 exhausted all inputs." in r1[impl, "join"]


FU = {"find_unused_parameters": True}  # b and never go unused


def _keywords():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel.distributed import _MixedPrecision

    from _conformance import Branchy, Mixed

    init_process_group(timeout=60)
    r, n = rank(), world_size()
    out = {}
    for impl in IMPLS:
        for name, kw in (("static_change", dict(static_graph=True)),
                         ("skip", dict(find_unused_parameters=True, skip_all_reduce_unused_params=True)),
                         ("skip_static", dict(static_graph=True, skip_all_reduce_unused_params=True)),
                         ("caps", dict(bucket_cap_mb_list=[0.0001, 25], **FU)),
                         ("batched", dict(batched_grad_copy=True, **FU)),
                         ("mesh", dict(device_mesh=init_device_mesh("cpu", (n,)), **FU))):
            model = Branchy()
            transport = Recording() if impl == "fanfold/torch" else None
            tiny = {} if "bucket_cap_mb_list" in kw else dict(bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0001)
            ddp = wrap(impl, model, **kw) if transport is None else \
                fanfold.DDP(model, transport=transport, **tiny, **kw)
            layout = [len(m) for m in ddp.reducer.buckets] if impl != "torch" else None
            names = {p: k for k, p in model.named_parameters()}
            steps = branchy_steps(ddp, model, r, n, 3, "later" if name == "static_change" else False)
            out[impl, name] = steps, layout, transport and sorted({
                names[ddp.reducer.params[i]] for b in transport.buckets for i in ddp.reducer.buckets[b]})
    model = Branchy()  # delay_all_reduce_named_params: a's gradients in one all-reduce outside the buckets
    ddp = fanfold.DDP(model, delay_all_reduce_named_params=list(model.a.named_parameters(prefix="a")),
                      param_to_hook_all_reduce=model.out.weight, **FU)
    out["delayed"] = branchy_steps(ddp, model, r, n, 2), [ddp.module.a.weight is p for p in ddp.reducer.params]
    model = Checkpointed("middle")  # every parameter delayed: no bucket at all
    ddp = fanfold.DDP(model, delay_all_reduce_named_params=list(model.named_parameters()),
                      param_to_hook_all_reduce=model.c.weight)
    out["all_delayed"] = train(ddp, model, 3, r, n), len(ddp.reducer.params)
    for impl in IMPLS:  # torch's private switch, which its own error message recommends
        model = Checkpointed("shared")
        ddp = wrap(impl, model)
        ddp._set_static_graph()
        out[impl, "set_static"] = train(ddp, model, 3, r, n)
    for impl in IMPLS:  # mixed precision: bfloat16 compute, float32 reduction and master weights
        model = Mixed()
        cfg = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        try:
            ddp = wrap(impl, model, mixed_precision=cfg)
            got = []
            for step, micro in ((0, 1), (1, 2)):
                model.zero_grad(set_to_none=True)
                for m in range(micro):
                    x, y = data(step + m)
                    loss = ((ddp(shard(x, r, n)).float() - shard(y, r, n)) ** 2).mean()
                    if m < micro - 1:
                        with ddp.no_sync():
                            ((ddp(shard(x, r, n)).float() - shard(y, r, n)) ** 2).mean().backward()
                    else:
                        loss.backward()
                got.append(grads(model))
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-0.1)
            x = shard(data(0)[0], r, n)
            model.zero_grad(set_to_none=True)
            ddp(x).float().sum().backward()
            alone = grads(model)
            model.zero_grad(set_to_none=True)
            pending = ddp(x)
            with torch.no_grad():  # evaluation between a forward and its backward: the copies stay until then
                ddp(x)
            pending.float().sum().backward()
            with torch.no_grad():
                ddp(x)  # and afterwards the masters are back
            out[impl, "mixed"] = (got, model.seen, [p.dtype for p in model.parameters()],
                                  [b.dtype for b in model.buffers()], close(alone, grads(model), atol=0))
        except RuntimeError as exc:
            out[impl, "mixed"] = str(exc)
    return out


def test_keywords_have_torchs_meaning():
    from _conformance import Branchy, mixed_oracle

    r0, r1 = fanfold.launch(_keywords, nprocs=2, timeout=280)
    plain = oracle(Branchy, 3)
    for res in (r0, r1):
        for impl in IMPLS:
            for name in ("skip", "skip_static", "caps", "batched", "mesh"):
                steps, layout, issued = res[impl, name]
                assert len(steps) == 3 and all(close(g, e) for g, e in zip(steps, plain)), (impl, name)
            # static_graph: b unused in the first iteration, used in the second: torch's error, fanfold's names
            change = res[impl, "static_change"][0]
            assert len(change) == 2 and isinstance(change[1], str), impl
            assert "Your training graph has changed in this iteration" in change[1], change  # torch's words
            if impl != "torch":
                assert "'b." in change[1]
        # never reduced: the buckets holding only never-used parameters (find_unused, or static: known after one)
        assert not any(k.startswith("never") for k in res["fanfold/torch", "skip"][2])
        assert any(k.startswith("a.") for k in res["fanfold/torch", "skip"][2])
        # caps of 104 bytes, then 25 MiB: out.bias and out.weight (144 bytes) close the first bucket, the rest share one
        assert res["fanfold/shm", "caps"][1] == [2, 6]
        steps, in_buckets = res["delayed"]
        assert all(close(g, e) for g, e in zip(steps, plain)) and not any(in_buckets)
        steps, bucketed = res["all_delayed"]
        assert bucketed == 0 and len(steps) == 3
        assert all(close(g, e) for g, e in zip(steps, oracle(functools.partial(Checkpointed, "middle"), 3)))
        shared = oracle(functools.partial(Checkpointed, "shared"), 3)
        for impl in IMPLS:
            assert len(res[impl, "set_static"]) == 3, res[impl, "set_static"]
            assert all(close(g, e) for g, e in zip(res[impl, "set_static"], shared)), impl
        mixed = mixed_oracle(torch.bfloat16)
        assert "cpu backend doesn't support events" in res["torch", "mixed"]  # torch's needs CUDA streams
        for impl in IMPLS[1:]:
            got, seen, params, buffers, unchanged_by_eval = res[impl, "mixed"]
            assert all(close(g, e) for g, e in zip(got, mixed)), impl
            assert unchanged_by_eval, impl  # an evaluation forward before or after the backward changes nothing
            assert seen == (torch.bfloat16, torch.bfloat16) and params == [torch.float32] * 5
            assert buffers == [torch.bfloat16, torch.int64]


COUNTS = (3, 1)  # batches per rank: rank 1 joins early and shadows rank 0's steps


def _join_mirrors():
    from _conformance import Embedder, sgd, tokens

    init_process_group(timeout=60)
    r, n = rank(), world_size()
    out = {}
    for impl in IMPLS[1:]:
        for name, kw in (("sparse", {}), ("static", {"static_graph": True}), ("unused", FU),
                         ("delayed", {"delay_all_reduce_named_params": "out", **FU})):
            model = Embedder()
            if name == "delayed":
                kw = {**kw, "delay_all_reduce_named_params": list(model.out.named_parameters(prefix="out")),
                      "param_to_hook_all_reduce": model.bag.weight}
            ddp = wrap(impl, model, **kw)
            with ddp.join():
                for step in range(COUNTS[r]):
                    x, y = tokens(step)
                    model.zero_grad(set_to_none=True)
                    ((ddp(shard(x, r, n), use_emb=name != "unused" or r == 0) - shard(y, r, n)) ** 2).mean().backward()
                    sgd(model)
            out[impl, name] = [p.detach().clone() for p in model.parameters()]
    return out


def test_join_mirrors_sparse_static_unused_and_delayed_reductions():
    from _conformance import Embedder, sgd, tokens

    r0, r1 = fanfold.launch(_join_mirrors, nprocs=2, timeout=280)
    for name in ("sparse", "static", "unused", "delayed"):
        model = Embedder()
        for step in range(max(COUNTS)):
            x, y = tokens(step)
            model.zero_grad(set_to_none=True)
            active = [k for k in range(2) if step < COUNTS[k]]  # divided by the initial world size, as torch
            sum(((model(shard(x, k, 2), use_emb=name != "unused" or k == 0) - shard(y, k, 2)) ** 2).mean()
                for k in active).div(2).backward()
            sgd(model)
        for impl in IMPLS[1:]:
            for res in (r0, r1):
                assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(res[impl, name], model.parameters())), \
                    (impl, name)


def _device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    init_process_group(timeout=60)
    n = world_size()
    mesh, flat = init_device_mesh("cpu", (n,)), init_device_mesh("cpu", (1, n))
    out = {}
    for impl in IMPLS:
        ddp = wrap(impl, nn.Linear(2, 2), device_mesh=mesh)
        out[impl, "attribute"] = ddp.device_mesh is mesh
        for name, kw in (("both", dict(device_mesh=mesh, process_group=mesh.get_group())),
                         ("2d", dict(device_mesh=flat))):
            try:
                wrap(impl, nn.Linear(2, 2), **kw)
                out[impl, name] = None
            except RuntimeError as exc:
                out[impl, name] = str(exc)
    return out


def test_device_mesh_is_kept_and_refused_with_torchs_words():
    """torch's test_ddp_device_mesh_initialization, on the CPU: the wrapper keeps ``device_mesh``; a mesh and a group,
    or a 2-D mesh, are refused with the words torch's test matches (case included)."""
    for out in fanfold.launch(_device_mesh, nprocs=2, timeout=120):
        for impl in IMPLS:
            assert out[impl, "attribute"], impl
            assert "Cannot specify both process_group and device_mesh arguments." in out[impl, "both"], out
            assert "Only 1D device mesh is supported," in out[impl, "2d"], out


class _Proxy(nn.Module):
    """a (data parallel) then b and a buffer that differ between ranks, left out of DDP by torch's private switch."""

    def __init__(self, r: int):
        super().__init__()
        torch.manual_seed(r)  # a differs too: DDP's broadcast makes it rank 0's
        self.a, self.b = nn.Linear(8, 4), nn.Linear(4, 4)
        with torch.no_grad():
            self.b.weight.fill_(r + 1.0)
        self.register_buffer("local", torch.full((3 + r,), float(r)))  # a different shape on each rank

    def forward(self, x):
        return self.b(self.a(x)) * self.local.sum()


def _ignored():
    init_process_group(timeout=60)
    r, n = rank(), world_size()
    out = {}
    for impl in IMPLS:
        model = _Proxy(r)
        cls = nn.parallel.DistributedDataParallel if impl == "torch" else fanfold.DDP
        cls._set_params_and_buffers_to_ignore_for_model(model, ["b.weight", "b.bias", "local"])
        ddp = wrap(impl, model)
        steps = []
        for step in range(2):
            x, y = data(step)
            model.zero_grad(set_to_none=True)
            ((ddp(shard(x, r, n)) - shard(y, r, n)) ** 2).mean().backward()
            steps.append(grads(model))
            sgd(model)
        steps.append({k: v.clone() for k, v in model.state_dict().items()})
        out[impl] = steps, getattr(model.b.weight, "_ddp_ignored", False)
    return out


def test_ignored_parameters_and_buffers_are_left_alone_like_torch():
    """``DDP._set_params_and_buffers_to_ignore_for_model``: the named parameters and buffers are neither checked
    across ranks (a buffer of another shape on each rank), broadcast nor averaged -- each rank keeps its own b and
    b's local gradient, a is averaged -- as with torch's DDP in the same ranks, every step."""
    res = fanfold.launch(_ignored, nprocs=2, timeout=120)
    for out in res:
        theirs, marked = out["torch"]
        assert marked
        for impl in IMPLS[1:]:
            got, marked = out[impl]
            assert marked, impl
            for step, (g, t) in enumerate(zip(got, theirs)):
                assert close(g, t), (impl, step, g, t)
    for impl in IMPLS:  # the case itself: b stays each rank's own, a is the same everywhere
        (s0, _), (s1, _) = res[0][impl], res[1][impl]
        assert not torch.equal(s0[-1]["b.weight"], s1[-1]["b.weight"]), impl
        assert torch.equal(s0[-1]["a.weight"], s1[-1]["a.weight"]), impl
