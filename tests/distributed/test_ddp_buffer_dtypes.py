"""Buffers of several dtypes (a BatchNorm's float statistics and int64 counter, a bool mask, a float64 and a
complex scale) are synced before each training forward from rank 0 as torch's DDP syncs them -- fanfold sends them as
one run of bytes, one collective, over gloo and over shared memory (which took no bool buffers before)."""
import torch
from torch import nn

import fanfold
from _conformance import IMPLS, wrap
from fanfold.distributed import init_process_group, rank


class _ManyBuffers(nn.Module):
    def __init__(self, r: int):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("mask", torch.tensor([True, r == 0, False, r == 1]))
        self.register_buffer("scale64", torch.tensor(2.0 + r, dtype=torch.float64))
        self.register_buffer("phase", torch.tensor([1 + 1j * r, -r + 0.5j], dtype=torch.complex64))
        offsets = torch.arange(6, dtype=torch.int32).reshape(2, 3) * (r + 1)
        self.register_buffer("offsets", offsets.t())  # not contiguous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x * self.mask)) * self.scale64.float() * self.phase.real.sum()


def _buffers_after_forwards():
    init_process_group(timeout=60)
    r = rank()
    out = {}
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(r))
    for impl in IMPLS:
        torch.manual_seed(0)
        model = _ManyBuffers(r)
        ddp = wrap(impl, model, init_sync=False)  # rank-local buffers until the first training forward syncs them
        with torch.no_grad():
            model.scale64.add_(10 * r)
        ddp(x).sum().backward()  # synced from rank 0, then rank 0's BatchNorm statistics moved on its own batch
        ddp(x).sum().backward()
        out[impl] = {n: b.clone() for n, b in model.named_buffers()}
    return out


def test_buffers_of_many_dtypes_sync_like_torchs_ddp():
    r0, r1 = fanfold.launch(_buffers_after_forwards, nprocs=2, timeout=200)
    for res in (r0, r1):
        for impl in IMPLS[1:]:
            assert res[impl].keys() == res["torch"].keys()
            for name, want in res["torch"].items():
                got = res[impl][name]
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (impl, name)
    # the oracle itself: before each training forward every rank takes rank 0's buffers
    assert torch.equal(r1["torch"]["mask"], torch.tensor([True, True, False, False]))
    assert r1["torch"]["scale64"].item() == 2.0
