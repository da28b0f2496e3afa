"""Start N local worker processes running one Python function: ``fanfold.launch(fn, *args, nprocs=N)``.

Sits beside the env contract (``fanfold.distributed.env``): each worker gets the same variables torchrun sets
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the function calls
``fanfold.distributed.init_process_group()`` exactly as a script under ``fanfold run`` would. The rendezvous store
is hosted by the launching process on a socket bound to 127.0.0.1 (workers connect to it as clients, as torchrun's
workers connect to their agent's store), and gloo is pinned to the loopback interface: nothing listens elsewhere.

Used by notebooks and by the test suite, so it must never hang: the whole run is bounded by ``timeout``; the first
rank that raises (or dies) ends the run, the others are killed, and the error names the rank and carries its
traceback. Workers start from a forkserver that has already imported torch (~0.3 s a rank instead of 5-15 s).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import wait
from typing import Any

__all__ = ["launch", "WorkerError", "free_port", "loopback_store", "loopback_interface"]

LOOPBACK = "127.0.0.1"


class WorkerError(RuntimeError):
    """A worker raised or died; ``rank`` names it and the message carries its traceback."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_store(timeout: float):
    """A TCPStore server listening on 127.0.0.1 only, on a port of its own; returns ``(store, port)``.

    Given a host name, TCPStore listens on every interface; given a socket already bound to loopback it listens on
    that alone. Binding the socket here also removes the race of "find a free port, then bind it".
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=timedelta(seconds=timeout), master_listen_fd=sock.detach())
    return store, port


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or None if not found."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in ("lo", "lo0") if n in names), None)


def _worker(fn, args, rank: int, env: Mapping[str, str], threads: int, conn) -> None:
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    import torch

    torch.set_num_threads(threads)
    try:
        payload = ("ok", fn(*args))
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then exit non-zero
        payload = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    try:
        data = pickle.dumps(payload)  # plain pickle: tensors are copied, not shared through fds that die with us
    except Exception as exc:
        data = pickle.dumps(("error", f"result of rank {rank} cannot be pickled: {exc}", ""))
    conn.send_bytes(data)
    conn.close()
    os._exit(0 if payload[0] == "ok" else 1)


def _context(fn: Callable, start_method: str | None):
    if start_method is None:
        # A function defined in __main__ (a notebook, a script) cannot be found by a forkserver child.
        start_method = "fork" if getattr(fn, "__module__", None) == "__main__" else "forkserver"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # torch._dynamo: creating any torch.optim optimizer imports it (4-15 s here); pay that once, not per rank.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.optim", "torch._dynamo", "fanfold"])
    return ctx


def _kill(procs: Sequence) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(2.0)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int = 2,
    timeout: float = 120.0,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    start_method: str | None = None,
) -> list:
    """Run ``fn(*args)`` in ``nprocs`` local processes with the torchrun environment; return the results by rank.

    ``fn`` must be importable by name (a module-level function) unless it lives in ``__main__``, in which case
    the workers are forked. Each worker uses ``threads`` intra-op threads. ``env`` adds environment variables.
    Raises :class:`WorkerError` naming the first rank that failed, with its traceback, or :class:`TimeoutError`
    naming the ranks still running after ``timeout`` seconds; in every case no worker is left running.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    ctx = _context(fn, start_method)
    store, port = loopback_store(timeout)
    lo = loopback_interface()
    base = {
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank, rank 0 included, is a client of the store above
        **({"GLOO_SOCKET_IFNAME": lo} if lo and "GLOO_SOCKET_IFNAME" not in os.environ else {}),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": str(threads),
        **(dict(env) if env else {}),
    }
    procs, conns = [], {}
    try:
        for rank in range(nprocs):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(fn, args, rank, base, threads, send), name=f"fanfold-rank{rank}")
            p.start()
            send.close()
            procs.append(p)
            conns[recv] = rank
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        while len(results) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(nprocs) if r not in results]
                raise TimeoutError(f"fanfold.launch: ranks {missing} of {nprocs} still running after {timeout:g} s")
            for obj in wait(list(conns) + list(sentinels), timeout=left):
                if obj in sentinels:
                    rank = sentinels.pop(obj)
                    recv = next((c for c, r in conns.items() if r == rank), None)
                    if recv is None:
                        continue  # its result was already read
                    if not recv.poll(0):
                        code = procs[rank].exitcode
                        raise WorkerError(f"rank {rank} of {nprocs} died with exit code {code} before reporting", rank)
                    obj = recv
                if obj in conns:
                    rank = conns.pop(obj)
                    try:
                        payload = pickle.loads(obj.recv_bytes())
                    except EOFError:
                        payload = None
                    if payload is None:
                        procs[rank].join(5.0)
                        code = procs[rank].exitcode
                        raise WorkerError(f"rank {rank} of {nprocs} died with exit code {code} before reporting", rank)
                    if payload[0] != "ok":
                        raise WorkerError(f"rank {rank} of {nprocs} failed: {payload[1]}\n{payload[2]}", rank)
                    results[rank] = payload[1]
        return [results[r] for r in range(nprocs)]
    finally:
        _kill(procs)
        for c in conns:
            c.close()
        del store  # the server stops with its last reference; the workers are gone
