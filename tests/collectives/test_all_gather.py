"""The shm transport's all_gather (through the ring, whether or not ranks may read each other's memory) on 2 and 3
ranks, against gloo's all_gather_into_tensor (bitwise: a copy): in place (ZeRO's parameter gather) and out of place,
odd lengths spanning several chunks, a non-contiguous output, float64, and the rank's part changed at once after the
wait (no peer reads it any more)."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fanfold
from fanfold.collectives.shm.transport import ShmTransport

CHUNK = 64 << 10
SIZES = [1, 4097, 70001, 3 * CHUNK + 5]


def _ranks():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out = []
    with ShmTransport(timeout=60, chunk_bytes=CHUNK) as t:
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
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_all_gather_equals_gloo(nprocs):
    for r, out in enumerate(fanfold.launch(_ranks, nprocs=nprocs, timeout=120)):
        for dtype, m, in_place, apart, strided in out:
            assert in_place and apart and strided, (r, dtype, m, in_place, apart, strided)
