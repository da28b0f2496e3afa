"""Run inside a private mount namespace whose /dev/shm is a 64 MB tmpfs (Docker's default), by test_small_shm.py:
``python _small_shm_job.py SCENARIO`` prints one line ``RESULT <json>``. ``BALLAST`` MiB of the tmpfs are taken
first (other users of /dev/shm: a DataLoader's workers, another job), so that the transport's usual segment does
not fit."""
import ctypes
import json
import mmap
import os
import signal
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import fanfold
from fanfold.collectives.shm.transport import SegmentSpaceError, ShmTransport

SHM = "/dev/shm"


def ballast(mib):
    fd = os.open(os.path.join(SHM, "ballast"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, mib << 20)
    os.close(fd)


def free_mib():
    st = os.statvfs(SHM)
    return st.f_bavail * st.f_frsize / 2**20


def _inputs(r):
    return torch.randn(5 << 20, generator=torch.Generator().manual_seed(r))  # 20 MB, a private tensor


def backend():
    """The fanfold backend's all_reduce of a 20 MB private tensor and of a small one."""
    dist.init_process_group("fanfold", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    x = _inputs(r)
    dist.all_reduce(x)
    expect = _inputs(0)
    for q in range(1, n):
        expect += _inputs(q)  # the transport's promise: the rank-order sum, in float32
    pg = dist.distributed_c10d._get_default_group()
    t = pg.transport
    out = {"equal": torch.equal(x, expect), "shm": t is not None, "chunk": t._chunk_bytes if t else None}
    y = torch.full((3,), float(r + 1))
    dist.all_reduce(y)  # the latency path too
    out["small"] = y.tolist()
    dist.destroy_process_group()
    return out


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 2048), nn.ReLU(), nn.Linear(2048, 512))


def _train(ddp, steps=3):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    r = dist.get_rank()
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * s + r)
        x, y = torch.randn(8, 1024, generator=g), torch.randn(8, 512, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def ddp(peer_read):
    """fanfold's DDP (transport: chosen, or the shm transport with or without peer reads) against torch's DDP."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    transport = None if peer_read is None else ShmTransport(peer_read=peer_read)
    # the ring with gradients as views of buckets
    model = fanfold.DDP(_model(), transport=transport, gradient_as_bucket_view=peer_read is False)
    ours = _train(model)
    inner = model.transport.inner
    out = {"transport": type(inner).__name__, "chunk": getattr(inner, "_chunk_bytes", None)}
    oracle = _train(torch.nn.parallel.DistributedDataParallel(_model()))  # torch's DDP over gloo
    out["close"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours, oracle, strict=True))
    out["max diff"] = max((a - b).abs().max().item() for a, b in zip(ours, oracle, strict=True))
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(ours, _model().parameters(), strict=False))
    dist.destroy_process_group()
    return out


def _touch_unreserved(size):
    # What a segment made with ftruncate alone would do: the pages are taken at the first touch, and a full tmpfs
    # answers with SIGBUS.
    fd = os.open(os.path.join(SHM, "unreserved"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    for off in range(0, size, 4096):
        ctypes.c_uint8.from_buffer(mm, off).value = 1
    os._exit(0)


def full():
    """No room even for the smallest chunks: asked for, the transport refuses at creation; chosen, torch's."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = {}
    try:
        ShmTransport()
        out["error"] = None
    except SegmentSpaceError as exc:
        out["error"] = str(exc)
    dist.destroy_process_group()
    out.update(ddp(None))
    return out


def main():
    scenario = sys.argv[1]
    result = {"free before": free_mib()}
    if scenario == "full":
        ballast(63)
        pid = os.fork()
        if pid == 0:
            _touch_unreserved(8 << 20)
        result["control"] = os.waitpid(pid, 0)[1]  # the raw wait status: signalled by SIGBUS
        os.unlink(os.path.join(SHM, "unreserved"))
        warnings.simplefilter("default")
        result["ranks"] = fanfold.launch(full, nprocs=2, timeout=180)
        result["backend"] = fanfold.launch(backend, nprocs=2, timeout=120)
    else:
        ballast(48)  # 16 MiB left: the 2-rank segment of 1 MiB chunks (16.1 MiB) does not fit
        fn, args = {"backend": (backend, ()), "ddp": (ddp, (None,)), "ddp ring": (ddp, (False,))}[scenario]
        warnings.simplefilter("default")  # Python's own rule (once per place and text): what users see
        result["ranks"] = fanfold.launch(fn, *args, nprocs=2, timeout=180)
    result["left"] = sorted(n for n in os.listdir(SHM) if n != "ballast")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    assert signal.SIGBUS  # Linux only, as the transport
    main()
