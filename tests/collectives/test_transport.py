"""The collective layer on its own: TorchTransport, its average, all-gather, reduce-scatter and the choice of
transport, each against values computed in the test (what every rank must hold)."""
import pytest
import torch
import torch.distributed as dist

import fanfold
from fanfold.collectives.select import resolve_transport, select_transport
from fanfold.collectives.transport import TorchTransport
from fanfold.distributed import init_process_group


def _collectives():
    init_process_group()
    r, n = dist.get_rank(), dist.get_world_size()
    t = TorchTransport()
    out = {"rank": (t.rank, t.world_size)}
    x = torch.arange(10, dtype=torch.float64) * (r + 1)
    t.all_reduce(x).wait()
    out["sum"] = x.tolist()
    y = torch.full((7,), float(r + 1))
    t.all_reduce(y, bucket=3, divisor=n).wait()
    out["mean"] = y.tolist()
    b = torch.full((3,), float(r))
    t.broadcast(b, n - 1)
    out["broadcast"] = b.tolist()
    t.barrier()
    every = torch.empty(n, 2, dtype=torch.int64)
    t.all_gather(torch.tensor([r, 10 * r + 1]), every.view(-1)).wait()
    out["rows"] = every.tolist()
    part = torch.empty(2, dtype=torch.float64)
    t.reduce_scatter(torch.arange(2.0 * n, dtype=torch.float64) * (r + 1), part, divisor=n).wait()
    out["part"] = part.tolist()
    out["choice"] = (select_transport(transport="torch"), type(resolve_transport("torch")).__name__)
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_torch_transport_collectives(nprocs):
    results = fanfold.launch(_collectives, nprocs=nprocs, timeout=120)
    k = nprocs * (nprocs + 1) // 2
    for r, out in enumerate(results):
        assert out["rank"] == (r, nprocs)
        assert out["sum"] == [i * k for i in range(10)]
        assert out["mean"] == [k / nprocs] * 7
        assert out["broadcast"] == [float(nprocs - 1)] * 3
        assert out["rows"] == [[q, 10 * q + 1] for q in range(nprocs)]
        assert out["part"] == [(2 * r + i) * k / nprocs for i in range(2)]
        assert out["choice"] == ("torch", "TorchTransport")


def test_the_collective_layer_needs_a_group():
    with pytest.raises(RuntimeError, match="TorchTransport needs an initialised process group"):
        TorchTransport()
    with pytest.raises(RuntimeError, match="choosing a transport needs an initialised process group"):
        select_transport()
