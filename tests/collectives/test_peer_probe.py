"""The capability probe behind the shared-memory transport's peer reads, against an independent check: two sibling
processes, one of which tries ``process_vm_readv`` on the other after that one allowed it (PR_SET_PTRACER, what
Yama's ptrace_scope=1 requires). ``ShmTransport.peer_read`` must say the same. The peer-read tests skip where this
capability is absent; this test is what keeps those skips honest."""
import ctypes
import multiprocessing as mp
import os
from datetime import timedelta

import torch.distributed as dist

import fanfold
from fanfold.collectives.shm.transport import ShmTransport

PR_SET_PTRACER, ANY = 0x59616D61, ctypes.c_ulong(2**64 - 1)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _owner(addr_w, done_r):
    value = ctypes.c_uint64(0xC0FFEE)
    ctypes.CDLL(None).prctl(PR_SET_PTRACER, ANY, 0, 0, 0)  # EINVAL without Yama: then nothing needs allowing
    os.write(addr_w, ctypes.addressof(value).to_bytes(8, "little"))
    os.read(done_r, 1)  # keep `value` alive until the reader is done


def _reader(pid, addr_r, ok_w):
    addr = int.from_bytes(os.read(addr_r, 8), "little")
    got = ctypes.c_uint64(0)
    fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    fn.restype = ctypes.c_ssize_t
    local, remote = _Iovec(ctypes.addressof(got), 8), _Iovec(addr, 8)
    n = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    os.write(ok_w, b"1" if n == 8 and got.value == 0xC0FFEE else b"0")


def _siblings_can_read() -> bool:
    ctx = mp.get_context("fork")
    addr_r, addr_w = os.pipe()
    done_r, done_w = os.pipe()
    ok_r, ok_w = os.pipe()
    owner = ctx.Process(target=_owner, args=(addr_w, done_r))
    owner.start()
    reader = ctx.Process(target=_reader, args=(owner.pid, addr_r, ok_w))
    reader.start()
    ok = os.read(ok_r, 1) == b"1"
    os.write(done_w, b"x")
    for p in (reader, owner):
        p.join(30)
        assert p.exitcode == 0
    for fd in (addr_r, addr_w, done_r, done_w, ok_r, ok_w):
        os.close(fd)
    return ok


def _rank():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    with ShmTransport(timeout=60) as t:
        return t.peer_read


def test_transport_probe_agrees_with_a_direct_sibling_read():
    expect = _siblings_can_read()
    assert fanfold.launch(_rank, nprocs=2, timeout=120) == [expect, expect]
