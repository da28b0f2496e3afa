"""The shm transport's all_gather where ranks read each other's memory (``gather.py``: each rank reads the peers'
parts straight from their outputs) on 2 and 3 ranks, against gloo's all_gather_into_tensor (bitwise: a copy): in
place (ZeRO's parameter gather) and out of place, odd lengths, a non-contiguous output, float64, and the rank's
part changed at once after the wait (the handle settles: no peer reads it any more)."""
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fanfold
from fanfold.collectives.shm.engine import PeerReader
from fanfold.collectives.shm.transport import ShmTransport

CHUNK = 64 << 10  # outputs above 16 KB take the peer reads
SIZES = [1, 4097, 70001, 3 * CHUNK + 5]


def _ranks():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out, calls = [], []
    gather = PeerReader.all_gather

    def counted(reader, part, *args):
        calls.append(part.numel())
        return gather(reader, part, *args)

    with ShmTransport(timeout=60, chunk_bytes=CHUNK) as t, mock.patch.object(PeerReader, "all_gather", counted):
        for dtype in (torch.float32, torch.float64):
            for m in SIZES:
                g = torch.Generator().manual_seed(31 * r + m)
                part = torch.randn(m, generator=g).to(dtype)
                want = torch.empty(n * m, dtype=dtype)
                dist.all_gather_into_tensor(want, part)
                flat = torch.full((n * m,), -1.0, dtype=dtype)  # in place: this rank's part already there
                flat[r * m:][:m].copy_(part)
                t.all_gather(flat[r * m:][:m], flat, bucket=m).wait()
                flat[r * m:][:m].fill_(float("nan"))  # the next step changes it at once: no peer may read it now
                apart = torch.full((n * m,), -1.0, dtype=dtype)
                t.all_gather(part, apart).wait()
                strided = torch.full((n * m, 2), -1.0, dtype=dtype)[:, 0]  # non-contiguous output
                t.all_gather(part, strided).wait()
                out.append((str(dtype), m, torch.equal(torch.cat([want[:r * m], want[(r + 1) * m:]]),
                                                       torch.cat([flat[:r * m], flat[(r + 1) * m:]])),
                            torch.equal(apart, want), torch.equal(strided, want)))
        t.barrier()
        peer_read = t.peer_read
    return out, peer_read, calls


@pytest.mark.parametrize("nprocs", [2, 3])
def test_all_gather_reading_peers_equals_gloo(nprocs):
    results = fanfold.launch(_ranks, nprocs=nprocs, timeout=120)
    for r, (out, _, _) in enumerate(results):
        for dtype, m, in_place, apart, strided in out:
            assert in_place and apart and strided, (r, dtype, m, in_place, apart, strided)
    if not results[0][1]:
        pytest.skip("no process_vm_readv between siblings here (test_peer_probe.py): the ring ran")
    # the path: every output above a quarter chunk (float32, then float64), three gathers each, and nothing else
    want = sorted(m for size in (4, 8) for m in SIZES if size * m * nprocs > CHUNK // 4 for _ in range(3))
    for _, _, calls in results:
        assert sorted(calls) == want, calls
