"""fanfold.DistributedDataParallel on 2 gloo ranks against single-process torch: gradients, 20-step training (MLP
and a small transformer), bucket views, no_sync, a custom transport seeing the bucket order and the overlap."""
import torch

import fanfold
from _ddp_models import MODELS, batch, loss_fn, optimizer, shard, single_process, single_process_grads, train_ddp
from fanfold.distributed import TorchTransport, init_process_group, rank, world_size

TINY = dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)  # several buckets even for these small models


class RecordingTransport(TorchTransport):
    """The torch transport, recording each all-reduce's bucket label and how many gradients were ready then."""

    def __init__(self):
        super().__init__()
        self.calls, self.ddp = [], None

    def all_reduce(self, tensor, bucket=None, divisor=None):
        if bucket is not None:
            self.calls.append((bucket, len(self.ddp.reducer.order), len(self.ddp.reducer.params)))
        return super().all_reduce(tensor, bucket, divisor)


class Reordered(torch.nn.Module):
    """Registered in the reverse of use order, and the two branches summed in a rank-dependent order: the ready
    order differs from the parameter order and between ranks, so the rebuilt buckets must come from rank 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head, self.left, self.right = torch.nn.Linear(16, 8), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, flip=False):
        branches = (self.right(x), self.left(x)) if flip else (self.left(x), self.right(x))
        return self.head(torch.tanh(branches[0] + branches[1]))


def _reordered(flip):
    r, n = rank(), world_size()
    model = Reordered()
    ddp = fanfold.DDP(model, bucket_cap_mb=0.0006, first_bucket_cap_mb=0.0005)
    names = {p: name for name, p in model.named_parameters()}
    layout = lambda: [[names[ddp.reducer.params[i]] for i in members] for members in ddp.reducer.buckets]
    before, orders, seen = layout(), [], []
    for p in model.parameters():  # the order in which autograd finishes each gradient on this rank
        p.register_post_accumulate_grad_hook(lambda p: seen.append(names[p]))
    opt = optimizer(model)
    for step in range(3):
        x, y = batch("mlp", step)
        opt.zero_grad()
        loss_fn("mlp", ddp(shard(x, r, n), flip=flip and r == 1), shard(y, r, n)).backward()
        orders.append(list(seen))
        seen.clear()
        opt.step()
    return before, layout(), [p.detach().clone() for p in model.parameters()], orders[0]


def _train(kind, steps, **kwargs):
    model = MODELS[kind]()
    ddp = fanfold.DDP(model, **kwargs)
    return ddp, train_ddp(ddp, model, kind, steps)


def _equivalence():
    init_process_group(timeout=60)
    r, n = rank(), world_size()
    out = {}
    transport = RecordingTransport()
    model = MODELS["mlp"]()
    ddp = transport.ddp = fanfold.DDP(model, transport=transport, **TINY)
    x, y = batch("mlp", 0)
    loss_fn("mlp", ddp(shard(x, r, n)), shard(y, r, n)).backward()
    out["grads"] = [p.grad.clone() for p in model.parameters()]
    out["calls"], out["nbuckets"] = transport.calls, len(ddp.reducer.buckets)
    out["mlp"] = _train("mlp", 20)[1]
    out["mlp_tiny"] = _train("mlp", 20, **TINY)[1]
    out["lm"] = _train("lm", 20, **TINY)[1]
    ddp, out["view"] = _train("mlp", 20, gradient_as_bucket_view=True, **TINY)
    flats = ddp.reducer.flats
    out["is_view"] = all(
        any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in flats)
        for p in ddp.module.parameters()
    )
    # no_sync: two local micro-steps, then a synchronised one: the average of the three-step sums; twice, the
    # second time after zeroing .grad in place (with bucket views: zeroing the buckets themselves)
    for as_view in (False, True):
        model = MODELS["mlp"]()
        ddp = fanfold.DDP(model, gradient_as_bucket_view=as_view, **TINY)
        for round_ in range(2):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            for step in range(3):
                x, y = batch("mlp", step)
                if step < 2:
                    with ddp.no_sync():
                        loss_fn("mlp", ddp(shard(x, r, n)), shard(y, r, n)).backward()
                    out.setdefault("local", [p.grad.clone() for p in model.parameters()])
                else:
                    loss_fn("mlp", ddp(shard(x, r, n)), shard(y, r, n)).backward()
            out[f"no_sync_{as_view}_{round_}"] = [p.grad.clone() for p in model.parameters()]
    out["reordered"] = _reordered(flip=True)
    return out


def _close(a, b, rtol=1e-5, atol=1e-6):
    return all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_equivalence_with_single_process():
    r0, r1 = fanfold.launch(_equivalence, nprocs=2, timeout=240)
    # one step: the averaged gradient is the full-batch gradient, bitwise the same on both ranks
    assert _equal(r0["grads"], r1["grads"])
    assert _close(r0["grads"], single_process_grads("mlp"), rtol=0, atol=1e-6)
    # buckets were launched in bucket order, the first one while backward was still producing gradients
    assert r0["nbuckets"] >= 3
    assert [b for b, _, _ in r0["calls"]] == list(range(r0["nbuckets"]))
    assert r0["calls"][0][1] < r0["calls"][0][2]
    # buckets rebuilt once from the observed ready order (rank 0's), the same on both ranks, training unchanged
    before, after, params, order = r0["reordered"]
    assert before[0] == ["right.bias", "right.weight"] and after[0][0].startswith("head.")
    assert r1["reordered"][3] != order and r1["reordered"][1] == after
    model, opt = Reordered(), None
    opt = optimizer(model)
    for step in range(3):
        x, y = batch("mlp", step)
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    assert _close(params, list(model.parameters())) and _equal(params, r1["reordered"][2])
    # 20 SGD+momentum steps: equal across ranks and to one process on the full batch
    mlp, lm = single_process("mlp", 20), single_process("lm", 20)
    for key, oracle in (("mlp", mlp), ("mlp_tiny", mlp), ("lm", lm), ("view", mlp)):
        assert _equal(r0[key], r1[key]), key
        assert _close(r0[key], oracle), key
    assert r0["is_view"] and r1["is_view"]
    # no_sync: the local micro-steps differ between ranks; the synchronised sum equals the big-batch gradient
    assert not _equal(r0["local"], r1["local"])
    big = single_process_grads("mlp", micro_steps=3)
    for key in ("no_sync_False_0", "no_sync_False_1", "no_sync_True_0", "no_sync_True_1"):
        assert _equal(r0[key], r1[key]), key
        assert _close(r0[key], big, rtol=0, atol=1e-6), key
