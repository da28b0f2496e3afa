"""``ShmTransport.reduce_scatter_tensors`` on 2 and 3 ranks: private tensors laid end to end, this rank's part of
their sum. Against a single-process rank-order sum of every rank's inputs (bitwise), gloo's reduce_scatter_tensor
(close: gloo sums in its own order), and bitwise the shm all-reduce's part and the fallback through the ring; odd
sizes, several tensors, empty and padded parts, float64 and bfloat16, divisor, the compression rounding, settle,
and mismatches named with the ranks."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fanfold
from fanfold.collectives.shm.transport import ShmTransport

CHUNK = 64 << 10  # pieces of 64 KB read from a peer at a time: several pieces at cheap sizes
CASES = [[1], [2, 3], [7], [3, 4097, 0, 5, 3 * CHUNK // 2 + 1], [100003], [1 + k % 3 for k in range(40)]]


def _inputs(sizes, r, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(1000 * r + sum(sizes) + len(sizes))
    return [(torch.randn(m, generator=g) * scale).to(dtype) for m in sizes]


def _oracle(xs, n, divisor, dtype):
    """Every rank's concatenation summed in rank order in float32 (float64 for float64), divided, zero-padded to n
    equal parts: what every algorithm of the transport computes. Two bfloat16 ranks round the sum before dividing
    (torch's bfloat16 add, then division); more sum and divide in float32 and round once."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    cats = [torch.cat(x).to(wide) for x in xs]
    acc = cats[0] + cats[1]
    for c in cats[2:]:
        acc = acc + c
    if dtype == torch.bfloat16 and n == 2:
        acc = acc.to(dtype)
    if divisor is not None:
        acc = acc / divisor
    acc = acc.to(dtype)
    total, chunk = acc.numel(), -(-acc.numel() // n)
    return torch.cat([acc, torch.zeros(chunk * n - total, dtype=dtype)]).view(n, chunk)


def _ranks():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out = {"cases": [], "errors": {}}
    with ShmTransport(timeout=60, chunk_bytes=CHUNK) as t, \
            ShmTransport(timeout=60, chunk_bytes=CHUNK, peer_read=False) as ring:
        out["peer read"] = t.peer_read
        held = []
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            for k, sizes in enumerate(CASES):
                for divisor in (None, n):
                    settle = (k + (divisor is None)) % 2 == 0
                    xs = [_inputs(sizes, q, dtype) for q in range(n)]
                    mine = [x.clone() for x in xs[r]]
                    total = sum(sizes)
                    chunk = -(-total // n)
                    got = torch.full((chunk,), 7.0, dtype=dtype)  # padding must come back zero
                    t.reduce_scatter_tensors(mine, got, bucket=k, divisor=divisor, settle=settle).wait()
                    held.append(mine)  # settle=False: peers may still read them until the next collective
                    want = _oracle(xs, n, divisor, dtype)[r]
                    fallback = torch.empty(chunk, dtype=dtype)
                    ring.reduce_scatter_tensors([x.clone() for x in xs[r]], fallback, divisor=divisor).wait()
                    whole = [x.clone() for x in xs[r]]
                    t.reduce_tensors(whole, divisor=divisor).wait()
                    flat = torch.cat(whole + [torch.zeros(chunk * n - total, dtype=dtype)])
                    gloo = torch.empty(chunk, dtype=torch.float64)
                    padded = torch.cat([torch.cat(xs[r]).double(), torch.zeros(chunk * n - total, dtype=torch.float64)])
                    dist.reduce_scatter_tensor(gloo, padded)
                    if divisor is not None:
                        gloo /= divisor
                    out["cases"].append(((str(dtype), k, divisor, settle), torch.equal(got, want),
                                         torch.equal(got, fallback), torch.equal(got, flat[r * chunk:][:chunk]),
                                         torch.allclose(got.double(), gloo, rtol=1e-2 if dtype == torch.bfloat16
                                                        else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-6),
                                         torch.equal(torch.cat(mine), torch.cat(xs[r]))))  # inputs untouched
        t.barrier()
        del held
        # compress: the compression hooks' recipe (fp16 divides first; cast, all-reduce, cast back), its part
        out["compress"] = []
        for narrow in (torch.bfloat16, torch.float16):
            sizes = [5, 3 * CHUNK // 2 + 1, 2]
            xs = [_inputs(sizes, q, scale=100.0) for q in range(n)]
            total, chunk = sum(sizes), -(-sum(sizes) // n)
            got = torch.empty(chunk)
            t.reduce_scatter_tensors([x.clone() for x in xs[r]], got, divisor=n, compress=narrow).wait()
            first = torch.cat(xs[r]) / (n if narrow == torch.float16 else 1)
            rounded = first.to(narrow)
            ring.all_reduce(rounded, divisor=None if narrow == torch.float16 else n).wait()
            want = torch.cat([rounded.float(), torch.zeros(chunk * n - total)])[r * chunk:][:chunk]
            fallback = torch.empty(chunk)
            ring.reduce_scatter_tensors([x.clone() for x in xs[r]], fallback, divisor=n, compress=narrow).wait()
            out["compress"].append((torch.equal(got, want), torch.equal(fallback, want),
                                    not torch.equal(rounded.float(), first)))  # really rounded
        with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor of ceil"):
            t.reduce_scatter_tensors([torch.ones(5)], torch.empty(5))
        with pytest.raises(ValueError, match="out overlaps"):
            x = torch.ones(12)
            t.reduce_scatter_tensors([x[:8]], x[6:6 + -(-8 // n)])
    # mismatches: every rank refuses, naming the other's collective (a failed transport stays failed: one each)
    for name, tensors, out_len in (("total", [torch.ones(6 + 3 * r)], -(-(6 + 3 * r) // n)),
                                   ("dtype", [torch.ones(6, dtype=torch.float64 if r else torch.float32)], -(-6 // n))):
        with ShmTransport(timeout=30, chunk_bytes=CHUNK) as t:
            try:
                t.reduce_scatter_tensors(tensors, torch.empty(out_len, dtype=tensors[0].dtype), bucket=5).wait()
            except RuntimeError as e:
                out["errors"][name] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    return request.param, fanfold.launch(_ranks, nprocs=request.param, timeout=240)


def test_reduce_scatter_tensors_equals_rank_order_sum_and_gloo(results):
    n, out = results
    assert len({o["peer read"] for o in out}) == 1
    for r, o in enumerate(out):
        for key, exact, fallback, all_reduce_part, near_gloo, untouched in o["cases"]:
            assert exact, (r, key, "not the single-process rank-order sum")
            assert fallback and all_reduce_part, (r, key, "differs from the ring's / the all-reduce's part")
            assert near_gloo and untouched, (r, key)
        assert o["compress"] == [(True, True, True)] * 2, o["compress"]
    if not out[0]["peer read"]:
        pytest.skip("no process_vm_readv between siblings here (test_peer_probe.py): the ring fallback ran")


def test_reduce_scatter_tensors_mismatch_named(results):
    n, out = results
    for r, o in enumerate(out):
        other = 1 if r == 0 else 0
        total = o["errors"]["total"]
        assert f"rank {r} is in reduce_scatter of {6 + 3 * r} float32 #" in total and "(bucket 5)" in total, total
        assert f"rank {other} is in reduce_scatter of {6 + 3 * other} float32" in total, total
        dtype = o["errors"]["dtype"]
        assert f"rank {other} is in reduce_scatter of 6 {'float64' if other else 'float32'}" in dtype, dtype
