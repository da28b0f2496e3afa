"""``fanfold doctor``: what fanfold will do on this machine and why (torch's build, CPUs, accelerators, backends,
``/dev/shm``, and from two real workers whether shared memory and peer reads work); exit 1 if something is missing."""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import __version__
from ..distributed import ShmTransport, init_process_group, select_transport
from ..launcher.agent import threads_per_worker
from ..launcher.spawn import WorkerError, launch


@dataclass(frozen=True)
class ProbeResult:
    chosen: str
    shm_sum: float | None  # the all-reduce's result through /dev/shm, or None when it could not be built
    shm_error: str
    peer_reads: bool


def _probe() -> ProbeResult:
    init_process_group(backend="gloo", timeout=60.0)
    chosen = select_transport()
    total, error, peer = None, "", False
    try:
        transport = ShmTransport()
        t = torch.tensor([float(dist.get_rank() + 1)])
        transport.all_reduce(t).wait()
        total, peer = t.item(), transport.peer_read
        transport.close()
    except Exception as exc:  # reported, not raised: the doctor says why
        error = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return ProbeResult(chosen, total, error, peer)


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().strip()
    return None


def _peer_read_reason() -> str:
    scope = _read("/proc/sys/kernel/yama/ptrace_scope")
    status = _read("/proc/self/status") or ""
    seccomp = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("Seccomp:")), None)
    why = []
    if not sys.platform.startswith("linux"):
        why.append("not Linux (process_vm_readv is Linux-only)")
    if scope not in (None, "0"):
        why.append(f"Yama ptrace_scope is {scope} (0 lets processes of one user read each other; or CAP_SYS_PTRACE)")
    if seccomp not in (None, "0"):
        why.append(f"a seccomp filter is active (Seccomp: {seccomp}); container profiles often forbid the call")
    return "; ".join(why) or "process_vm_readv was refused (ptrace rights)"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=120.0, metavar="S",
                        help="seconds allowed for the two probe workers")
    parser.add_argument("--no-probe", action="store_true",
                        help="skip the two probe workers (no collective, shared-memory or peer-read check)")


def main(args: argparse.Namespace) -> int:
    missing: list[str] = []
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    usable = threads_per_worker(1)  # the cores this process may run on
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    lines = [("fanfold", f"{__version__} ({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})"),
             ("python", f"{platform.python_version()} ({sys.executable})"),
             ("torch", f"{torch.__version__} ({build})"),
             ("CPUs", f"{usable} usable by this process of {os.cpu_count()}; torch threads "
                      f"{torch.get_num_threads()}; `fanfold run -n N` gives each worker max(1, {usable} // N)"),
             ("accelerators", f"{len(gpus)} CUDA: {', '.join(gpus)}" if gpus else
              "none: DataParallel and DDP run CPU replicas (device_ids=['cpu', 'cpu'])")]
    backends = {b: getattr(dist, f"is_{b}_available")() for b in ("gloo", "nccl", "mpi", "ucc")}
    lines.append(("backends", ", ".join(f"{b}: {'yes' if ok else 'no'}" for b, ok in backends.items())))
    if not backends["gloo"]:
        missing.append("the gloo backend (CPU process groups)")
    if os.path.isdir("/dev/shm"):
        du = shutil.disk_usage("/dev/shm")
        lines.append(("/dev/shm", f"{_size(du.total)} total, {_size(du.free)} free"))
    else:
        lines.append(("/dev/shm", "absent: no shared-memory collectives (torch's collectives are used)"))
    if args.no_probe or missing:
        lines.append(("workers", "not probed" + (" (--no-probe)" if args.no_probe else "")))
    else:
        lines += _probe_lines(args.timeout, missing)
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    if missing:
        print(f"fanfold doctor: missing: {'; '.join(missing)}")
        return 1
    print("fanfold doctor: everything fanfold needs is here")
    return 0


def _probe_lines(timeout: float, missing: list[str]) -> list[tuple[str, str]]:
    try:
        results = launch(_probe, nprocs=2, timeout=timeout)
    except (WorkerError, TimeoutError, OSError) as exc:
        missing.append("two local workers that can all-reduce over gloo")
        return [("workers", f"2 local gloo workers FAILED: {str(exc).splitlines()[0]}")]
    lines = [("workers", "2 local gloo workers: started, all-reduced")]
    res = results[0]
    if res.shm_sum == 3.0 and all(r.shm_sum == 3.0 for r in results):
        note = "" if res.chosen == "shm" else f" (not chosen by default here: fanfold picks {res.chosen!r})"
        lines.append(("shm collectives", f"work: 2 ranks summed through /dev/shm{note}"))
        if all(r.peer_reads for r in results):
            lines.append(("peer reads", "work: DDP's buckets are summed straight from the peers' memory"))
        else:
            lines.append(("peer reads", f"not available: {_peer_read_reason()}; the shared-memory ring is used"))
    else:
        why = next((r.shm_error for r in results if r.shm_error), f"wrong sum {res.shm_sum} (expected 3.0)")
        lines.append(("shm collectives", f"do not work here: {why}; torch's collectives are used"))
        lines.append(("peer reads", "not probed (no shared-memory transport)"))
    return lines
