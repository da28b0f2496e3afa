"""The hierarchical transport (shared memory inside a host, gloo across) against gloo on the same inputs, on hosts
simulated with a mount namespace per rank (``_simhosts.py``; root needed, skipped otherwise): 2 hosts x 2 ranks,
2 x 1 and an uneven 1 + 2; and forced on one real host (no root needed). Every collective against gloo (bitwise
for sums of integer-valued floats), the same bits on every rank and run after run, which path each layout takes,
fanfold's DDP against one process on the whole batch, and the ``fanfold`` backend (torch's collectives and torch's
DDP against gloo; FSDP2 and HSDP against one process)."""
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _simhosts import cannot_simulate, host_directories, on_host
from torch import nn

import fanfold
from fanfold.collectives.hierarchical import PIECE_BYTES, HierarchicalTransport, host_layout
from fanfold.collectives.select import select_transport

LAYOUTS = {"2x2": [0, 0, 1, 1], "2x1": [0, 1], "1+2": [0, 1, 1], "one host, forced": [0, 0]}
_WHY_NOT = cannot_simulate()


def test_layout_places_ranks_and_shards():
    two_by_two = host_layout(["a", "a", "b", "b"])
    assert two_by_two.hosts == ((0, 1), (2, 3)) and two_by_two.shards == 2 and two_by_two.worthwhile
    assert [two_by_two.owned(r) for r in range(4)] == [(0,), (1,), (0,), (1,)]
    assert [two_by_two.cross(k) for k in range(2)] == [(0, 2), (1, 3)]
    interleaved = host_layout(["a", "b", "a", "b"])
    assert interleaved.hosts == ((0, 2), (1, 3)) and interleaved.place(3) == (1, 1)
    uneven = host_layout(["b", "a", "a"])  # 1 + 2: rank 0 owns both shards of its host
    assert uneven.hosts == ((0,), (1, 2)) and uneven.owned(0) == (0, 1) and uneven.cross(1) == (0, 2)
    two_three = host_layout(["a", "a", "b", "b", "b"])  # 3 shards; a host of 2 ranks: local 0 owns shards 0 and 2
    assert two_three.shards == 3 and two_three.owned(0) == (0, 2) and two_three.owned(1) == (1,)
    assert two_three.cross(2) == (0, 4)
    assert not host_layout(["a", "b"]).worthwhile and not host_layout(["a", "a"]).worthwhile
    with pytest.raises(ValueError, match="rank 5"):
        two_by_two.place(5)


def _ints(numel, r, dtype, seed):
    g = torch.Generator().manual_seed(7919 * seed + 31 * r + 1)
    return torch.randint(-50, 50, (numel,), generator=g).to(dtype)


def _same_on_every_rank(t):
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t)
    return all(torch.equal(rows[0].view(torch.uint8) if t.dtype.is_floating_point else rows[0],
                           x.view(torch.uint8) if t.dtype.is_floating_point else x) for x in rows)


def _transport_checks():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    out = {"chosen": select_transport()}
    t = HierarchicalTransport()
    out["hosts"] = [len(m) for m in t.layout.hosts]
    checks, seed = {}, 0
    # sums of integer-valued floats are exact in any order: bitwise gloo's
    for numel in (1, 3, 1000, 65537):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
            seed += 1
            x = _ints(numel, r, dtype, seed)
            want = x.clone()
            dist.all_reduce(want)
            t.all_reduce(x).wait()
            checks[f"all_reduce {numel} {dtype}"] = torch.equal(x, want)
    for op, gloo_op in (("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX), ("product", dist.ReduceOp.PRODUCT)):
        x = _ints(777, r, torch.float32, 50).clamp(-3, 3)
        want = x.clone()
        dist.all_reduce(want, op=gloo_op)
        t.all_reduce(x, op=op).wait()
        checks[f"all_reduce {op}"] = torch.equal(x, want)
    # random floats: gloo's within rounding; the same bits on every rank and run after run; a divisor after the sum
    x = torch.randn(40001, generator=torch.Generator().manual_seed(r))
    want, got, again, avg = x.clone(), x.clone(), x.clone(), x.clone()
    dist.all_reduce(want)
    t.all_reduce(got).wait()
    t.all_reduce(again).wait()
    t.all_reduce(avg, divisor=n).wait()
    checks["floats close to gloo"] = torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    checks["run after run"] = torch.equal(got.view(torch.int32), again.view(torch.int32))
    checks["every rank"] = _same_on_every_rank(got)
    checks["divisor"] = torch.equal(avg, got / n)
    # a non-contiguous tensor, written back in place
    x = _ints(24, r, torch.float32, 60).view(6, 4).t()
    want = x.contiguous()
    dist.all_reduce(want)
    t.all_reduce(x).wait()
    checks["strided"] = torch.equal(x, want)
    # several in flight at once (DDP's buckets): each its own gloo result
    xs = [_ints(k * 1001 + 1, r, torch.float32, 70 + k) for k in range(5)]
    wants = [x.clone() for x in xs]
    for w in wants:
        dist.all_reduce(w)
    works = [t.all_reduce(x, bucket=k) for k, x in enumerate(xs)]
    for w in works:
        w.wait()
    checks["in flight"] = all(torch.equal(x, w) for x, w in zip(xs, wants))
    # reduce_tensors, with a divisor and compressed to bfloat16
    pieces = [_ints(k + 5, r, torch.float32, 80 + k) for k in range(3)]
    whole = torch.cat(pieces)
    dist.all_reduce(whole)
    t.reduce_tensors(pieces, divisor=n).wait()
    checks["reduce_tensors"] = torch.equal(torch.cat(pieces), whole / n)
    pieces = [_ints(k + 5, r, torch.float32, 90 + k) for k in range(3)]
    whole = torch.cat(pieces)
    dist.all_reduce(whole)
    t.reduce_tensors(pieces, compress=torch.bfloat16).wait()
    checks["reduce_tensors bf16"] = torch.equal(torch.cat(pieces), whole)
    # several pieces (PIECE_BYTES), their boundaries inside tensors: gloo's sum; random floats the same bits on
    # every rank, and the divisor after the sum
    step = PIECE_BYTES // 4
    x = _ints(2 * step + step // 2 + 3, r, torch.float32, 140)
    want = x.clone()
    dist.all_reduce(want)
    t.all_reduce(x).wait()
    checks["all_reduce in pieces"] = torch.equal(x, want)
    pieces = [_ints(k, r, torch.float32, 150 + k) for k in (step - 5, 7, step + 11, 0, step // 3)]
    whole = torch.cat(pieces)
    dist.all_reduce(whole)
    t.reduce_tensors(pieces, divisor=n).wait()
    checks["reduce_tensors in pieces"] = torch.equal(torch.cat(pieces), whole / n)
    x = torch.randn(3 * step + 1, generator=torch.Generator().manual_seed(r))
    t.all_reduce(x).wait()
    checks["pieces: every rank"] = _same_on_every_rank(x)
    # reduce_scatter: this rank's part of gloo's reduction; the input is left as it was
    for numel, op, gloo_op, divisor in ((11, "sum", dist.ReduceOp.SUM, 2), (1, "sum", dist.ReduceOp.SUM, None),
                                        (300, "max", dist.ReduceOp.MAX, None)):
        x = _ints(n * numel, r, torch.float32, 100 + numel)
        kept, want, part = x.clone(), x.clone(), torch.empty(numel)
        dist.all_reduce(want, op=gloo_op)
        t.reduce_scatter(x, part, divisor=divisor, op=op).wait()
        want = want[r * numel:(r + 1) * numel] / (divisor or 1)
        checks[f"reduce_scatter {numel} {op}"] = torch.equal(part, want) and torch.equal(x, kept)
    # reduce_scatter_tensors: this rank's part of gloo's reduction of the zero-padded concatenation
    pieces = [_ints(k, r, torch.float32, 160 + k) for k in (5, 0, 2 * n + 3)]
    total = sum(p.numel() for p in pieces)
    size = -(-total // n)
    want, got = torch.cat(pieces + [torch.zeros(size * n - total)]), torch.empty(size)
    dist.all_reduce(want)
    t.reduce_scatter_tensors(pieces, got, divisor=2).wait()
    checks["reduce_scatter_tensors"] = torch.equal(got, want[r * size:(r + 1) * size] / 2)
    # all_gather: gloo's; also in place (this rank's tensor is its place in out, as ZeRO's)
    for dtype in (torch.float32, torch.int64):
        x = _ints(13, r, dtype, 110)
        want, got = torch.empty(n * 13, dtype=dtype), torch.empty(n * 13, dtype=dtype)
        dist.all_gather_into_tensor(want, x)
        t.all_gather(x, got).wait()
        checks[f"all_gather {dtype}"] = torch.equal(got, want)
    buf = torch.zeros(n * 9)
    buf[r * 9:(r + 1) * 9] = _ints(9, r, torch.float32, 120)
    want = torch.empty(n * 9)
    dist.all_gather_into_tensor(want, buf[r * 9:(r + 1) * 9].clone())
    t.all_gather(buf[r * 9:(r + 1) * 9], buf).wait()
    checks["all_gather in place"] = torch.equal(buf, want)
    # broadcast from every rank
    for src in range(n):
        x, want = _ints(17, r, torch.float32, 130 + src), _ints(17, r, torch.float32, 130 + src)
        t.broadcast(x, src)
        dist.broadcast(want, src)
        checks[f"broadcast from {src}"] = torch.equal(x, want)
    # barrier: no rank leaves it before every rank has reached it (the later ranks arrive late)
    store = dist.distributed_c10d._get_default_store()
    time.sleep(0.3 * (n - 1 - r))
    store.set(f"arrived/{r}", "1")
    t.barrier()
    checks["barrier"] = store.check([f"arrived/{q}" for q in range(n)])
    out["checks"] = checks
    out["ddp"] = _fanfold_ddp()
    t.close()
    dist.destroy_process_group()
    return out


_BATCH, _STEPS = 12, 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _data(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(_BATCH, 16, generator=g), torch.randn(_BATCH, 8, generator=g)


def _fanfold_ddp():
    """fanfold's DDP with its transport chosen as usual, several buckets; the transport's class and the final
    parameters."""
    model = _model()
    ddp = fanfold.DDP(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    return type(ddp.transport.inner).__name__, _train(model, ddp, dist.get_rank(), dist.get_world_size())


def _train(model, wrapped, r, n):
    """SGD with momentum through ``wrapped`` (``model``, or a wrapper of it) on rank ``r``'s share (of ``n``) of
    each global batch; the final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per = _BATCH // n
    for step in range(_STEPS):
        x, y = _data(step)
        opt.zero_grad()
        nn.functional.mse_loss(wrapped(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per]).backward()
        opt.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _one_process():
    model = _model()
    return _train(model, model, 0, 1)


def _launch(name, fn, timeout=300, env=None):
    hosts = LAYOUTS[name]
    if name == "one host, forced":
        return fanfold.launch(on_host, fn, [], hosts, nprocs=len(hosts), timeout=timeout,
                              env={"FANFOLD_TRANSPORT": "hierarchical", **(env or {})}), None
    if _WHY_NOT:
        pytest.skip(_WHY_NOT)
    with host_directories(max(hosts) + 1) as dirs:
        out = fanfold.launch(on_host, fn, dirs, hosts, nprocs=len(hosts), timeout=timeout, env=env)
        left = {d: os.listdir(d) for d in dirs if os.listdir(d)}
    return out, left


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collectives_match_gloo_and_ddp_matches_one_process(name):
    out, left = _launch(name, _transport_checks)
    assert not left, f"segments left in the simulated hosts' /dev/shm: {left}"
    hosts = LAYOUTS[name]
    sizes = [hosts.count(h) for h in sorted(set(hosts))]
    expected = {"2x2": ("hierarchical", "HierarchicalTransport"), "1+2": ("hierarchical", "HierarchicalTransport"),
                "2x1": ("torch", "TorchTransport"),  # one rank per host: every byte crosses anyway
                "one host, forced": ("hierarchical", "HierarchicalTransport")}[name]
    reference = _one_process()
    for r, o in enumerate(out):
        assert o["hosts"] == sizes, (r, o["hosts"])
        assert o["chosen"] == expected[0], (r, o["chosen"])
        failed = [k for k, ok in o["checks"].items() if not ok]
        assert not failed, (r, failed)
        kind, params = o["ddp"]
        assert kind == expected[1], (r, kind)
        for got, want in zip(params, reference):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # every rank ends with the same parameters, bit for bit
    for o in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o["ddp"][1], out[0]["ddp"][1]))


def _backend_checks():
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    checks = {}
    x = _ints(5000, r, torch.float32, 1)
    want = x.clone()
    dist.all_reduce(want, group=gloo)
    dist.all_reduce(x)
    checks["all_reduce"] = torch.equal(x, want)
    out = {"transport": type(dist.group.WORLD.transport).__name__}
    x = torch.randn(301, generator=torch.Generator().manual_seed(r))
    want = x.clone()
    dist.all_reduce(want, group=gloo)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    checks["avg"] = torch.allclose(x, want / n, rtol=1e-5, atol=1e-6)
    xs, ws = [_ints(7, r, torch.float64, 2), _ints(3, r, torch.float64, 3)], None
    ws = [v.clone() for v in xs]
    dist.all_reduce_coalesced(ws, group=gloo)
    dist.all_reduce_coalesced(xs)
    checks["coalesced"] = all(torch.equal(a, b) for a, b in zip(xs, ws))
    for src in range(n):
        a, b = _ints(9, r, torch.int64, 4 + src), _ints(9, r, torch.int64, 4 + src)
        dist.broadcast(a, src)
        dist.broadcast(b, src, group=gloo)
        checks[f"broadcast {src}"] = torch.equal(a, b)
    x = _ints(6, r, torch.float32, 10)
    a, b = torch.empty(n * 6), torch.empty(n * 6)
    dist.all_gather_into_tensor(a, x)
    dist.all_gather_into_tensor(b, x, group=gloo)
    la, lb = [torch.empty(6) for _ in range(n)], [torch.empty(6) for _ in range(n)]
    dist.all_gather(la, x)
    dist.all_gather(lb, x, group=gloo)
    checks["all_gather"] = torch.equal(a, b) and all(torch.equal(p, q) for p, q in zip(la, lb))
    x = _ints(n * 4, r, torch.float32, 11)
    a, b = torch.empty(4), torch.empty(4)
    dist.reduce_scatter_tensor(a, x)
    dist.reduce_scatter_tensor(b, x, group=gloo)
    checks["reduce_scatter"] = torch.equal(a, b)
    a, b = torch.empty(n * 2), torch.empty(n * 2)
    dist.all_to_all_single(a, _ints(n * 2, r, torch.float32, 12))
    dist.all_to_all_single(b, _ints(n * 2, r, torch.float32, 12), group=gloo)
    checks["all_to_all (gloo's)"] = torch.equal(a, b)
    dist.barrier()
    # torch's DDP over the fanfold backend against over gloo
    results = {}
    for name, group in (("gloo", gloo), ("fanfold", None)):
        model = _model()
        results[name] = _train(model, nn.parallel.DistributedDataParallel(model, process_group=group,
                                                                          bucket_cap_mb=0.002), r, n)
    checks["torch DDP"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                              for a, b in zip(results["gloo"], results["fanfold"]))
    out["checks"] = checks
    # FSDP2 over the whole group, and HSDP (shard inside a host, replicate across) where the hosts are equal
    from torch.distributed.device_mesh import DeviceMesh
    meshes = {"fsdp": DeviceMesh.from_group(dist.group.WORLD, "cpu")}
    if n == 4:
        meshes["hsdp"] = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
    out["sharded"] = {name: _sharded(mesh) for name, mesh in meshes.items()}
    if n == 4:
        out["hsdp groups"] = [type(meshes["hsdp"].get_group(d).transport).__name__
                              for d in ("shard", "replicate")]
    dist.destroy_process_group()
    return out


def _sharded(mesh):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train(model, model, dist.get_rank(), dist.get_world_size())


@pytest.mark.parametrize("name", ["2x2", "1+2"])
def test_backend_matches_gloo(name):
    out, left = _launch(name, _backend_checks)
    assert not left, left
    reference = _one_process()
    for r, o in enumerate(out):
        assert o["transport"] == "HierarchicalTransport", (r, o["transport"])
        failed = [k for k, ok in o["checks"].items() if not ok]
        assert not failed, (r, failed)
        assert set(o["sharded"]) == ({"fsdp", "hsdp"} if len(out) == 4 else {"fsdp"}), set(o["sharded"])
        for kind, params in o["sharded"].items():
            for got, want in zip(params, reference):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, kind=kind: f"{kind}: {m}")
        if len(out) == 4:  # the shard dimension is one host's ranks: shared memory; replicate: one per host
            assert o["hsdp groups"] == ["ShmTransport", "NoneType"], o["hsdp groups"]


def _stall():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    t = HierarchicalTransport()
    t.all_reduce(torch.ones(64)).wait()
    message = None
    if r != 3:  # rank 3 (host 1) never joins this one: its cross-host partner and its host's ranks must say so
        start = time.monotonic()
        try:
            t.all_reduce(torch.ones(64)).wait()
        except Exception as exc:  # noqa: BLE001 - the test looks at what arrived
            message = (str(exc), time.monotonic() - start)
        store.set(f"done/{r}", "1")
    else:
        store.wait([f"done/{q}" for q in range(3)], timedelta(seconds=60))
    return message


def test_a_rank_missing_on_the_other_host_is_diagnosed_on_both_hosts():
    out, _ = _launch("2x2", _stall, env={"FANFOLD_STALL_TIMEOUT": "3"})
    for r in range(3):
        assert out[r] is not None, f"rank {r} did not fail"
        message, waited = out[r]
        assert waited < 30, (r, waited)
        assert "hierarchical transport" in message, (r, message)
    # rank 1's cross-host partner is rank 3; rank 2 waits for rank 3 at home, so rank 0 waits for rank 2 across
    assert "rank 1 (host 0 of 2" in out[1][0] and "across hosts (gloo group of ranks [1, 3])" in out[1][0], out[1][0]
    assert "rank 0 (host 0 of 2" in out[0][0] and "across hosts" in out[0][0], out[0][0]
    assert "rank 2 (host 1 of 2" in out[2][0] and "[2, 3]" in out[2][0], out[2][0]
