"""DDP.join() with uneven inputs (5 vs 8 batches, and 0 vs 2) and the comm hooks (bf16, fp16, a torch-style hook
returning a torch future, a custom hook on the bucket API), on 2 gloo ranks against single-process oracles; join()
with ranks whose models disagree, on 2 and 3 ranks, against torch's DDP over gloo."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fanfold
from _ddp_models import batch, loss_fn, mlp, optimizer, shard, single_process_grads
from fanfold.distributed import bf16_compress_hook, fp16_compress_hook, init_process_group, rank

BATCHES = (5, 8)  # per rank


def norm_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 8))


def _train_uneven(counts, **join_kwargs):
    r = rank()
    model = norm_mlp()
    ddp = fanfold.DDP(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    opt = optimizer(model)
    with ddp.join(**join_kwargs):
        for step in range(counts[r]):
            x, y = batch("mlp", step)
            opt.zero_grad()
            loss_fn("mlp", ddp(shard(x, r, 2)), shard(y, r, 2)).backward()
            opt.step()
    return [t.detach().clone() for t in model.state_dict().values()]


def _torch_style_hook(group, bucket):
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _recording_hook(seen, bucket):
    seen.append((bucket.index(), bucket.is_last(), len(bucket.parameters()), len(bucket.gradients())))
    return bucket.all_reduce(bucket.buffer()).then(lambda fut: fut.value() / bucket.divisor)


def _one_step_grads(state, hook):
    r = rank()
    model = mlp()
    ddp = fanfold.DDP(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    ddp.register_comm_hook(state, hook)
    x, y = batch("mlp", 0)
    loss_fn("mlp", ddp(shard(x, r, 2)), shard(y, r, 2)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _worker():
    init_process_group(timeout=60)
    out = {
        "join": _train_uneven(BATCHES),
        "join_active": _train_uneven(BATCHES, divide_by_initial_world_size=False),
        "join_empty": _train_uneven((0, 2)),
    }
    for name, hook in (("bf16", bf16_compress_hook), ("fp16", fp16_compress_hook), ("torch", _torch_style_hook)):
        out[name] = _one_step_grads(None, hook)
    seen = []
    out["custom"] = _one_step_grads(seen, _recording_hook)
    out["seen"] = seen
    return out


@pytest.fixture(scope="module")
def results():
    return fanfold.launch(_worker, nprocs=2, timeout=240)


def _oracle_uneven(counts, divide_by_initial):
    """Steps where both ranks train average both shards' gradients; afterwards the last rank's gradient is divided
    by the initial world size (or by 1). From the second step on, each forward starts from the buffers of the
    highest active rank; the final model is the highest last joiner's (torch's DDP's choices, both)."""
    model = norm_mlp()
    opt = optimizer(model)
    replicas = [copy.deepcopy(model) for _ in range(2)]
    for step in range(max(counts)):
        x, y = batch("mlp", step)
        grads, active = [], [r for r in range(2) if step < counts[r]]
        buffers = {k: v.clone() for k, v in replicas[active[-1]].named_buffers()} if step > 0 else {}
        for r in active:
            rep = replicas[r]
            rep.load_state_dict({**rep.state_dict(), **buffers, **dict(model.named_parameters())})
            rep.zero_grad()
            loss_fn("mlp", rep(shard(x, r, 2)), shard(y, r, 2)).backward()
            grads.append([p.grad for p in rep.parameters()])
        divisor = 2 if divide_by_initial else len(grads)
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / divisor
        opt.step()
    last = max(range(2), key=lambda r: (counts[r], r))
    return [t.detach().clone() for t in {**replicas[last].state_dict(), **dict(model.named_parameters())}.values()]


@pytest.mark.parametrize("key,counts,divide", [("join", BATCHES, True), ("join_active", BATCHES, False),
                                               ("join_empty", (0, 2), True)])
def test_join_uneven_inputs_end_with_equal_models(results, key, counts, divide):
    r0, r1 = results
    assert all(torch.equal(a, b) for a, b in zip(r0[key], r1[key]))  # parameters and buffers, bitwise
    oracle = _oracle_uneven(counts, divide)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(r0[key], oracle))


def test_compression_hooks_within_tolerance(results):
    r0, r1 = results
    exact = single_process_grads("mlp")
    for name, rtol in (("bf16", 2e-2), ("fp16", 2e-3)):
        assert all(torch.equal(a, b) for a, b in zip(r0[name], r1[name])), name
        err = max(((a - b).abs() / (b.abs().max())).max().item() for a, b in zip(r0[name], exact))
        assert 1e-7 < err < rtol, (name, err)  # compressed, and close


def test_torch_style_and_custom_hooks(results):
    r0, r1 = results
    exact = single_process_grads("mlp")
    for name in ("torch", "custom"):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(r0[name], exact)), name
    assert r0["seen"] == [(0, False, 2, 2), (1, False, 2, 2), (2, True, 2, 2)]


def _disagreeing(counts):
    """Both DDPs in one job on the same data: each rank nudges its parameters by its own amount after every step
    (a rank-local update DDP does not synchronise), so which rank's model join() ends with, and which rank's
    BatchNorm statistics each forward starts from, show in the result."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    init_process_group(timeout=60)
    r, world = rank(), len(counts)
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name in ("torch", "fanfold"):
        model = norm_mlp()
        wrapped = (TorchDDP(model, process_group=gloo, bucket_cap_mb=0.002) if name == "torch"
                   else fanfold.DDP(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001))
        opt = optimizer(model)
        with wrapped.join():
            for step in range(counts[r]):
                x, y = batch("mlp", step)
                opt.zero_grad()
                loss_fn("mlp", wrapped(shard(x, r, world)), shard(y, r, world)).backward()
                opt.step()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * (r + 1))
        out[name] = [t.detach().clone() for t in model.state_dict().values()]
    return out


@pytest.mark.parametrize("counts", [(3, 5), (4, 2, 4)])
def test_join_ends_with_torchs_authoritative_rank(counts):
    # (3, 5): one last joiner; buffers during join come from the highest active rank. (4, 2, 4): ranks 0 and 2
    # join last and disagree; torch's DDP keeps rank 2's model
    results = fanfold.launch(_disagreeing, counts, nprocs=len(counts), timeout=240)
    for r, out in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(out["fanfold"], results[0]["fanfold"])), r
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(out["fanfold"], out["torch"])), r
