"""all_gather, reduce_scatter and all_to_all on the ``fanfold`` backend's shared memory, 2 and 3 ranks, against gloo
in the same processes as the oracle: list and into-tensor all_gather, reduce_scatter (SUM, AVG; bitwise equal to
the shared-memory all_reduce of the same data's shard, gloo's sum within rounding), all_to_all_single with equal
and unequal splits; fp32/fp64/bf16/int64, odd sizes and sizes of several chunks; mismatched splits and a missing
rank named within the timeout."""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fanfold

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]
SIZES = [1, 7, 1001, 300_001]  # 300_001: several 1 MiB chunks for every dtype, on 2 and 3 ranks


def _x(shape, r, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * seed + 17 * r + 1))
    return x.to(dtype) if dtype.is_floating_point else (x * 1000).round().to(dtype)


def _close(a, b):
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    tol = 2e-2 if a.dtype == torch.bfloat16 else 1e-5
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


def _init():
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo")


def _splits(r, n, rows):
    # rank p sends ((p + q) % 3 + q) * rows rows to rank q (some pairs none): unequal in every direction
    send = [((r + q) % 3 + q) * rows for q in range(n)]
    recv = [((p + r) % 3 + r) * rows for p in range(n)]
    return send, recv


def _exchanges():
    r, n, gloo = _init()
    dist.barrier()  # creates the shared-memory transport
    shm = dist.group.WORLD.transport
    bad, issued, start = [], 0, shm.issued  # counts the collectives that ran in shared memory
    for dtype in DTYPES:
        for m in SIZES:
            x = _x((m,), r, dtype, seed=m)
            got, want = [torch.empty_like(x) for _ in range(n)], [torch.empty_like(x) for _ in range(n)]
            work = dist.all_gather(got, x, async_op=True)
            work.wait()
            dist.all_gather(want, x, group=gloo)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                bad.append(("all_gather", dtype, m))
            into, oracle = torch.empty(n * m, dtype=dtype), torch.empty(n * m, dtype=dtype)
            work = dist.all_gather_into_tensor(into, x, async_op=True)
            # get_future().done(): an async Work in flight at return is torch's holder of fanfold's, whose
            # is_completed() is the holder's own (docs/backend.md, Semantics)
            if work.get_future().wait()[0] is not into or not work.get_future().done():
                bad.append(("all_gather_into_tensor future", dtype, m))
            dist.all_gather_into_tensor(oracle, x, group=gloo)
            if not torch.equal(into, oracle):
                bad.append(("all_gather_into_tensor", dtype, m))
            # in place, as ZeRO gathers its parameters: the input is this rank's own part of the output
            inplace = torch.zeros(n * m, dtype=dtype)
            inplace[r * m:(r + 1) * m] = x
            dist.all_gather_into_tensor(inplace, inplace[r * m:(r + 1) * m])
            if not torch.equal(inplace, oracle):
                bad.append(("all_gather_into_tensor in place", dtype, m))
            issued += 3
            full = _x((n * m,), r, dtype, seed=m + 1)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                    continue
                shard, listed, summed, oracle = (torch.empty(m, dtype=dtype) for _ in range(4))
                dist.reduce_scatter_tensor(shard, full, op=op)
                dist.reduce_scatter(listed, list(full.chunk(n)), op=op)
                everything = full.clone()
                dist.all_reduce(everything, op=op)  # the shared-memory all_reduce: the same bits for the shard
                dist.reduce_scatter_tensor(oracle, full, group=gloo)
                if op == dist.ReduceOp.AVG:  # gloo has no AVG: its sum divided by n
                    oracle = oracle / n
                issued += 3
                mine = everything[r * m:(r + 1) * m]
                if not (torch.equal(shard, mine) and torch.equal(listed, mine) and _close(shard, oracle)):
                    bad.append(("reduce_scatter", str(op), dtype, m))
            for rows, cols in ((2, 3), (4, 70_001)):  # the second: several steps for a pair
                y = _x((n * rows, cols), r, dtype, seed=rows)
                a, b = torch.empty_like(y), torch.empty_like(y)
                dist.all_to_all_single(a, y)
                dist.all_to_all_single(b, y, group=gloo)
                send, recv = _splits(r, n, rows // 2)
                z = _x((sum(send), cols), r, dtype, seed=rows + 1)
                c, d = torch.empty(sum(recv), cols, dtype=dtype), torch.empty(sum(recv), cols, dtype=dtype)
                dist.all_to_all_single(c, z, recv, send)
                dist.all_to_all_single(d, z, recv, send, group=gloo)
                issued += 2
                if not (torch.equal(a, b) and torch.equal(c, d)):
                    bad.append(("all_to_all", dtype, rows, cols))
    # non-contiguous output: written back in place
    x = _x((3, 4), r, torch.float32)
    out, want = torch.empty(4, 3 * n).t(), torch.empty(3 * n, 4)
    dist.all_gather_into_tensor(out, x)
    dist.all_gather_into_tensor(want, x, group=gloo)
    issued += 1
    if not torch.equal(out, want):
        bad.append(("all_gather_into_tensor non-contiguous output",))
    ran = shm.issued - start
    dist.destroy_process_group()
    return bad, ran, issued


@pytest.mark.parametrize("nprocs", [2, 3])
def test_exchanges_match_gloo(nprocs):
    for bad, ran, issued in fanfold.launch(_exchanges, nprocs=nprocs, timeout=400):
        assert bad == [], bad
        assert ran >= issued, f"only {ran} of {issued} collectives ran in shared memory"


def _mismatch():
    r, n, _ = _init()
    dist.barrier()
    x = torch.ones(4 * n)
    send = [4] * n
    recv = [4] * n
    if r == 0:  # rank 0 expects 2 elements from rank 1, which sends 4
        recv = [4, 2] + [4] * (n - 2)
    try:
        dist.all_to_all_single(torch.empty(sum(recv)), x, recv, send)
        message = None
    except Exception as exc:  # noqa: BLE001
        message = str(exc)
    dist.destroy_process_group()
    return message


def _stall():
    r, n, _ = _init()
    group = dist.new_group(backend="fanfold", timeout=timedelta(seconds=3))
    dist.all_reduce(torch.ones(4), group=group)  # every rank: the transport exists
    message = None
    if r == 0:  # rank 1 never joins this one
        start = time.monotonic()
        try:
            dist.all_gather_into_tensor(torch.empty(4 * n), torch.ones(4), group=group)
        except Exception as exc:  # noqa: BLE001
            message = (str(exc), time.monotonic() - start)
    dist.barrier(group=dist.new_group(backend="gloo"))
    dist.destroy_process_group()
    return message


def test_mismatched_splits_are_named_on_every_rank():
    for message in fanfold.launch(_mismatch, nprocs=2, timeout=120):
        assert message is not None and "rank 1 sends 4 elements to rank 0, which expects 2" in message, message


def test_missing_rank_is_named_within_the_timeout():
    message, waited = fanfold.launch(_stall, nprocs=2, timeout=120, env={"FANFOLD_STALL_TIMEOUT": ""})[0]
    assert "all_gather" in message and "rank 1" in message, message
    assert waited < 30
