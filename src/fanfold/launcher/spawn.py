"""``fanfold.launch(fn, *args, nprocs=N)``: run a Python function on N local worker processes with torchrun's
environment, so ``fn`` calls ``init_process_group()`` as a script under ``fanfold run`` would. Everything listens on
127.0.0.1 only: the job's store (hosted here, behind the launch's secret) and gloo. docs/launching.md, notebooks.md."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from .._core.job import SECRET_ENV, STORE_ENV, StoreServer, install_env_rendezvous, new_secret
from .worker_shim import DEBUG_ENV, debug_tracebacks, format_traceback, headline, refuse_job_store_clients, whole_lines

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def loopback_env() -> dict[str, str]:
    """The variables that keep gloo's and NCCL's own listening sockets on the loopback interface (``lo`` on Linux,
    ``lo0`` on macOS), those not set already; none where no such interface is found."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    lo = next((n for n in ("lo", "lo0") if n in names), None)
    return {var: lo for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if lo and var not in os.environ}


class WorkerError(RuntimeError):
    """A worker raised or died; ``rank`` names it and the message carries its traceback."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class _Report:
    """A worker's result, or its failure and when it happened (to find the first); ``died``: it never reported. A
    failure's ``traceback`` comes as the user reads it and in ``full`` (``FANFOLD_DEBUG=1`` in the launching process
    chooses), with the ``headline`` of a fanfold error."""

    ok: bool
    value: Any = None
    error: str = ""
    traceback: str = ""
    full: str = ""
    headline: str | None = None
    time_ns: int = 0
    died: bool = False


def _worker(fn, args, rank: int, env: Mapping[str, str], threads: int, conn, rank_prefix: bool) -> None:
    # A forked worker inherits its parent's handlers: one that raises (torch's elastic agent leaves such a handler
    # after `launch_script`) printed a traceback when the launcher stopped this worker. Stopped is stopped.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    streams = whole_lines(f"[rank {rank}] " if rank_prefix else "")  # ranks sharing a notebook cell
    torch.set_num_threads(threads)
    install_env_rendezvous()  # a plain dist.init_process_group() joins the launch's authenticated store too
    refuse_job_store_clients(dist.TCPStore)  # MASTER_PORT is that store: a TCPStore client fails at once
    try:
        report = _Report(True, fn(*args))
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then exit non-zero
        try:
            shown, full, line = format_traceback(exc), format_traceback(exc, debug=True), headline(exc)
        except Exception:  # noqa: BLE001 - the failure must be reported, if not as fanfold would show it
            shown = full = traceback.format_exc()
            line = None
        report = _Report(False, error=f"{type(exc).__name__}: {exc}", traceback=shown, full=full, headline=line,
                         time_ns=time.time_ns())
    # Pickled before the process group is torn down (torch's storage pickling after it was seen to hang); a failure
    # is sent before too: the teardown makes the peers fail, and their reports must not overtake this one.
    try:
        data = pickle.dumps(report)  # plain pickle: tensors are copied, not shared through fds that die with us
    except Exception as exc:
        report = _Report(False, error=f"result of rank {rank} cannot be pickled: {exc}", time_ns=time.time_ns())
        data = pickle.dumps(report)
    if not report.ok:
        conn.send_bytes(data)
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    for stream in streams:  # os._exit skips every flush: what the worker printed must reach the parent first
        stream.close_line()
        stream.flush()
    if report.ok:
        conn.send_bytes(data)
    conn.close()
    os._exit(0 if report.ok else 1)


def _context(fn: Callable, start_method: str | None):
    # spawn and forkserver find fn by its module and name: not a notebook cell's or a script's function (the new
    # process has another __main__), nor a lambda, a nested function or a method of an unpicklable object
    try:
        by_reference = getattr(fn, "__module__", None) not in (None, "__main__") and bool(pickle.dumps(fn))
    except Exception:
        by_reference = False
    if start_method is None:
        start_method = "forkserver" if by_reference else "fork"
    elif start_method != "fork" and not by_reference:
        raise ValueError(f"fn {getattr(fn, '__qualname__', fn)!r} is defined in __main__ (a notebook or a script) or "
                         f"is not a module-level function: start_method={start_method!r} cannot find it in the new "
                         f"process; leave start_method=None (fork) or move fn into an importable module")
    if start_method == "fork":
        # A forked child inherits the parent's CUDA context in a state it cannot use: refuse before starting.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError(
                "fanfold.launch: CUDA is already initialised in this process, and the workers of a function defined "
                "in a notebook (or __main__) are forked, which cannot use it. Restart the kernel and launch before "
                "any CUDA call in it (no tensor .cuda()/.to('cuda') and no torch.cuda.* query that initialises it), "
                "or move the function into a module so the workers start fresh")
        if dist.is_initialized():
            raise RuntimeError("fanfold.launch: a process group is initialised in this process; forked workers "
                               "would inherit it: call torch.distributed.destroy_process_group() first")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # torch._dynamo: creating any torch.optim optimizer imports it (seconds); pay that once, not per rank.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.optim", "torch._dynamo", "fanfold"])
    return ctx


def _collect(procs: Sequence, conns: Sequence, timeout: float, debug: bool = False) -> list:
    # A rank's failure usually makes its peers fail too: after the first failure the others are awaited a moment
    # (2 s), and the earliest by the worker's own clock is reported; a rank that died without reporting is the cause.
    results: dict[int, Any] = {}
    failures: dict[int, _Report] = {}
    pending = dict(enumerate(conns))  # rank -> its pipe, until read
    end = time.monotonic() + timeout
    while pending and time.monotonic() < end:
        # the pipe for a report, the sentinel for a death (a process the worker started may hold the pipe open)
        ready = set(wait([*pending.values(), *(procs[r].sentinel for r in pending)], end - time.monotonic()))
        for rank in [r for r in pending if pending[r] in ready or procs[r].sentinel in ready]:
            conn = pending.pop(rank)
            try:
                report = pickle.loads(conn.recv_bytes()) if conn.poll(0) else None
            except (EOFError, OSError):
                report = None
            if report is not None and report.ok:
                results[rank] = report.value
                continue
            if report is None:
                procs[rank].join(5.0)
                report = _Report(False, error=f"died with exit code {procs[rank].exitcode}", time_ns=time.time_ns(),
                                 died=True)
            failures[rank] = report
            end = min(end, time.monotonic() + 2.0)
    if failures:
        rank = min(failures, key=lambda r: (not failures[r].died, failures[r].time_ns, r))
        first = failures[rank]
        if first.died:
            head = f"rank {rank} of {len(procs)} {first.error} before reporting"
        else:
            # a fanfold error's one-line diagnosis first (it names the rank), then the traceback with its details
            title = (f"fanfold: {first.headline}" if first.headline
                     else f"rank {rank} of {len(procs)} failed: {first.error}")
            head = f"{title}\n{(first.full if debug else first.traceback).rstrip()}"
        later = {r: f.error if f.died else f.error.split(":", 1)[0] for r, f in failures.items() if r != rank}
        raise WorkerError("\n".join([head, *later_failures("fanfold.launch", rank, sorted(pending), later)]), rank)
    if pending:
        raise TimeoutError(f"fanfold.launch: ranks {sorted(pending)} of {len(procs)} still running after {timeout:g} s")
    return [results[r] for r in range(len(procs))]


def reap(procs: Sequence, grace_s: float = 3.0) -> None:
    """Join ``procs`` within ``grace_s`` seconds in all; kill those still running."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)


def later_failures(who: str, rank: int, stopped: list[int], later: dict[int, str],
                   consequences: Mapping[int, tuple[list[int], str]] | None = None) -> list[str]:
    """The report's lines after the root cause's (``rank``): the ranks that failed because a peer was gone
    (``consequences``: rank -> (the peers, [] unknown; its error)), the ranks stopped, those that failed on their
    own later (``later``: rank -> its error)."""
    lines = []
    for r, (peers, what) in sorted((consequences or {}).items()):
        gone = (f"its peer rank {peers[0]} is gone" if len(peers) == 1 else
                f"its peer ranks {peers} are gone" if peers else "a peer is gone")
        lines.append(f"{who}: rank {r}: {gone} ({what})")
    lines += [f"{who}: stopped the other workers (ranks {stopped})"] if stopped else []
    return lines + [f"{who}: rank {r} also failed, after rank {rank} ({what})" for r, what in sorted(later.items())]


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int = 2,
    timeout: float = 120.0,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    start_method: str | None = None,
    rank_prefix: bool = False,
) -> list:
    """Run ``fn(*args)`` in ``nprocs`` local processes with the torchrun environment; return the results by rank.
    An importable module-level ``fn`` starts from a forkserver; one defined in a notebook or ``__main__`` (or a
    lambda, a closure) runs in forked workers, so the parent must not have initialised CUDA (a ``RuntimeError``
    says so). Each worker uses ``threads`` intra-op threads; ``env`` adds environment variables; output arrives
    in whole lines, ``rank_prefix=True`` starts each with ``[rank R] ``. Raises :class:`WorkerError` naming the
    first rank that failed, with its traceback (a fanfold error's headline first; fanfold's own frames cut, unless
    ``FANFOLD_DEBUG=1`` here or in ``env``), or :class:`TimeoutError` naming the ranks still running after
    ``timeout`` seconds; either way no worker is left running.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    ctx = _context(fn, start_method)
    secret = new_secret()
    store = StoreServer(secret.encode(), host=LOOPBACK)
    base = {
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(store.port),
        **loopback_env(),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": str(threads),
        **(dict(env) if env else {}),
        STORE_ENV: "1",  # every rank, rank 0 included, is a client of the store above
        SECRET_ENV: secret,  # in the environment, never on a command line: only this user can read it
    }
    procs, conns = [], []
    try:
        for rank in range(nprocs):
            recv, send = ctx.Pipe(duplex=False)
            conns.append(recv)
            p = ctx.Process(target=_worker, args=(fn, args, rank, base, threads, send, rank_prefix),
                            name=f"fanfold-rank{rank}")
            p.start()
            send.close()
            procs.append(p)
        debug = debug_tracebacks() or (env or {}).get(DEBUG_ENV) == "1"  # read here: a forkserver's env is old
        return _collect(procs, conns, timeout, debug)
    finally:
        for p in procs:
            p.terminate()  # a process that has exited is skipped
        reap(procs)
        for c in conns:
            c.close()
        store.close()  # the workers are gone
