"""Ranks of the ``fanfold`` backend never take different paths for one collective: every collective of the backend,
its last rank passing more elements, a size across a path's threshold, another dtype (one shared memory takes, one
it hands to gloo), another op, or an output that does not fit its input: every rank raises ShmMismatchError within
seconds (none aborts in gloo, none waits out a timeout), on 2 and 3 ranks. Correct programs whose ranks differ only
locally (a contiguous tensor on one, a strided one on another; an in-place reduce-scatter on one) give gloo's
results; ranks that all hand a collective to gloo get gloo's; ranks that all pass ill-fitting tensors get a
ValueError, and the group goes on."""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _mismatch_cases import COLLECTIVES, VARIANTS, applies, call

import fanfold

GROUP_TIMEOUT = 30.0  # a rank that took another path would wait this long: the errors must come well before


def _matrix():
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=120))
    n = dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    out = {}
    for collective in COLLECTIVES:
        for variant in [None, *VARIANTS]:
            if variant is not None and (not applies(collective, variant) or (n > 2 and variant not in _FEW)):
                continue
            group = dist.new_group(backend="fanfold", timeout=timedelta(seconds=GROUP_TIMEOUT))
            dist.all_reduce(torch.ones(1), group=group)  # the transport set up: the case's first step is its own
            start = time.monotonic()
            try:
                got = call(collective, variant, group)
                error = None
            except Exception as exc:  # noqa: BLE001 - the test looks at what arrived
                got, error = None, (type(exc).__name__, str(exc))
            waited = time.monotonic() - start
            if variant is None and got is not None:  # agreed: gloo's result, the oracle
                want = call(collective, None, gloo)
                error = None if all(torch.equal(a, b) for a, b in zip(got, want)) else ("differs from gloo", "")
            out[(collective, variant)] = (error, waited)
            group.shutdown()
    dist.destroy_process_group()
    return out


_FEW = ("more", "bigger", "bool", "input more")  # on 3 ranks


@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_rank_names_the_mismatch_on_every_collective(nprocs):
    out = fanfold.launch(_matrix, nprocs=nprocs, timeout=600)
    for r, results in enumerate(out):
        for (collective, variant), (error, waited) in results.items():
            case = (r, collective, variant, error)
            if variant is None:
                assert error is None, case
                continue
            assert error is not None and error[0] == "ShmMismatchError", case
            assert waited < GROUP_TIMEOUT / 2, (case, waited)  # named at once, not after a timeout
            others = [p for p in range(nprocs) if p != r]
            assert any(f"rank {p}" in error[1] for p in others), case  # names a peer


def _local_differences():
    torch.set_num_threads(1)
    dist.init_process_group("cpu:fanfold", timeout=timedelta(seconds=120))
    r, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    out = {"peer_read": dist.group.WORLD.shared_transport().peer_read}
    big = 300_000  # float32 elements: the peer reads' size where they are allowed
    # a correct program: a contiguous tensor on rank 0, a strided view of the same size on rank 1
    base = torch.arange(big, dtype=torch.float32).view(600, 500) * (r + 1)
    x = base.clone() if r == 0 else base.t().contiguous().t()
    want = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(want, group=gloo)
    dist.all_reduce(x)
    out["strided"] = torch.equal(x, want)
    # an in-place reduce_scatter (the output a view of the input) on rank 0, apart on rank 1
    inp = torch.arange(n * big, dtype=torch.float32) * (r + 1)
    want = torch.empty(big)
    dist.reduce_scatter_tensor(want, inp.clone(), group=gloo)
    got = inp[r * big:(r + 1) * big] if r == 0 else torch.empty(big)
    dist.reduce_scatter_tensor(got, inp)
    out["in place"] = torch.equal(got, want)
    # every rank hands the same to gloo: gloo's result
    bits = torch.tensor([0b1101, 0b0111 + r], dtype=torch.int64)
    want = bits.clone()
    dist.all_reduce(want, op=dist.ReduceOp.BAND, group=gloo)
    dist.all_reduce(bits, op=dist.ReduceOp.BAND)
    out["gloo's"] = torch.equal(bits, want)
    # every rank's output misfits its input: a ValueError on every rank, and the group goes on
    try:
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(n * 3 + 1))
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    y = torch.ones(5)
    dist.all_reduce(y)
    out["after"] = torch.equal(y, torch.full((5,), float(n)))
    dist.destroy_process_group()
    return out


def test_ranks_that_differ_only_locally_take_one_path():
    for out in fanfold.launch(_local_differences, nprocs=2, timeout=300):
        assert out["strided"] and out["in place"] and out["gloo's"] and out["after"], out
        assert out["refused"] is not None and "reduce_scatter_tensor" in out["refused"], out["refused"]
