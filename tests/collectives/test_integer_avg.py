"""ReduceOp.AVG of integer tensors on the ``fanfold`` backend (Lightning's ``sync_dist`` sends it for any backend not
named gloo), against a plain-Python oracle of NCCL's integer average: every rank's values summed, wrapped around in
the tensor's dtype, then divided by the group's size rounding toward zero. On shared memory and on gloo
(``FANFOLD_TRANSPORT=torch``), 2 and 3 ranks, every form that takes an op, synchronous and async."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fanfold

DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
BITS = {torch.int64: 64, torch.int32: 32, torch.int16: 16, torch.int8: 8, torch.uint8: 8}


def _values(rank: int, numel: int, dtype: torch.dtype) -> list[int]:
    """Rank ``rank``'s values: signed ones spread over the dtype's range (negative sums that do not divide evenly,
    sums that wrap around), the same on every rank that asks."""
    g = torch.Generator().manual_seed(7 + 31 * rank + BITS[dtype])
    low, high = (0, 256) if dtype == torch.uint8 else (-(2 ** (BITS[dtype] - 1)), 2 ** (BITS[dtype] - 1))
    big = torch.randint(max(low, -2**62), min(high, 2**62), (numel,), generator=g, dtype=torch.int64).tolist()
    small = torch.randint(max(low, -7), min(high, 8), (numel,), generator=g, dtype=torch.int64).tolist()
    return [b if i % 3 == 0 else s for i, (b, s) in enumerate(zip(big, small))]


def _oracle(numel: int, dtype: torch.dtype, n: int) -> list[int]:
    """NCCL's integer AVG in plain Python: the sum wrapped into the dtype, then C's division (toward zero)."""
    bits, signed = BITS[dtype], dtype != torch.uint8
    out = []
    for column in zip(*(_values(r, numel, dtype) for r in range(n))):
        s = sum(column) % 2 ** bits
        if signed and s >= 2 ** (bits - 1):
            s -= 2 ** bits
        q = abs(s) // n
        out.append(q if s >= 0 else -q)
    return out


def _averages(sizes):
    dist.init_process_group("fanfold", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    avg, wrong = dist.ReduceOp.AVG, []

    def check(what, got, numel, dtype):
        if got.dtype != dtype or got.tolist() != _oracle(numel, dtype, n):
            wrong.append(f"{what} {dtype} {numel}")

    for dtype in DTYPES:
        if dtype == torch.int16 and os.environ["FANFOLD_TRANSPORT"] == "torch":
            continue  # gloo refuses int16 for every op
        for numel in sizes:
            x = torch.tensor(_values(r, numel, dtype), dtype=dtype)
            dist.all_reduce(x, op=avg)
            check("all_reduce", x, numel, dtype)
            x = torch.tensor(_values(r, numel, dtype), dtype=dtype)
            work = dist.all_reduce(x, op=avg, async_op=True)
            work.wait()
            check("all_reduce async", x, numel, dtype)
            if work.get_future().wait()[0] is not x:
                wrong.append(f"all_reduce async future {dtype}")
            xs = [torch.tensor(_values(r, numel, dtype), dtype=dtype) for _ in range(2)]
            dist.all_reduce_coalesced(xs, op=avg)
            check("all_reduce_coalesced", xs[1], numel, dtype)
        # reduce-scatter: rank r's shard of every rank's input, averaged
        numel = n * 5
        full = _oracle(numel, dtype, n)
        out = torch.empty(5, dtype=dtype)
        dist.reduce_scatter_tensor(out, torch.tensor(_values(r, numel, dtype), dtype=dtype), op=avg)
        if out.tolist() != full[5 * r:5 * r + 5]:
            wrong.append(f"reduce_scatter_tensor {dtype}")
        ins = list(torch.tensor(_values(r, numel, dtype), dtype=dtype).chunk(n))
        dist.reduce_scatter(out, ins, op=avg)
        if out.tolist() != full[5 * r:5 * r + 5]:
            wrong.append(f"reduce_scatter {dtype}")
    transport_used = dist.group.WORLD.transport is not None
    dist.destroy_process_group()
    return wrong, transport_used


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_integer_avg_is_nccls(nprocs, transport):
    # 1 and 6 elements: the latency path; 40,000: the queued shared-memory path
    out = fanfold.launch(_averages, [1, 6, 40_000], nprocs=nprocs, timeout=240,
                         env={"FANFOLD_TRANSPORT": transport})
    for wrong, used in out:
        assert wrong == []
        assert used == (transport == "shm")
