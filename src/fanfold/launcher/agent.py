"""``fanfold run``: start N worker processes of a script on torch's elastic agent, and ``launch_script`` for Python.

A thin layer over ``torch.distributed.launcher.api`` (what torchrun runs): the workers get torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, ...), the agent restarts them up to ``--max-restarts`` times and stops all of them
when one fails. What it adds:

- single node by default, with a rendezvous whose only listening socket is bound to 127.0.0.1 (torchrun's
  ``--standalone`` store listens on every interface), and gloo/NCCL pinned to the loopback interface;
- the rendezvous store admits only processes that prove the job's secret (``fanfold._core.job_store``): made here
  (or the user's ``FANFOLD_JOB_SECRET``/``FANFOLD_JOB_SECRET_FILE``) and handed to the workers in their
  environment; the worker shim points torch's ``env://`` rendezvous at it, so plain scripts need no change;
- ``-n`` defaults to the number of GPUs, or 2 without one; OMP_NUM_THREADS = max(1, cores // N) per worker;
- each worker runs through the ``worker_shim``, so a failure is reported as the rank that failed first and its
  full traceback, instead of a ChildFailedError raised out of the launcher; the exit code is non-zero.

Layer: ``fanfold.launcher`` (below training and the CLI; imports torch only besides ``spawn``'s loopback
helpers). ``fanfold.cli.run`` parses ``fanfold run``'s flags and calls ``launch_script``; ``fanfold train`` does too.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

from .._core.job_store import SECRET_ENV, SECRET_FILE_ENV, STORE_ENV, JobStore, job_secret, new_secret
from .loopback import LOOPBACK, loopback_interface, loopback_store
from .target import check_module, check_script

__all__ = ["launch_script", "default_nproc_per_node", "threads_per_worker", "format_failure"]

_LOOPBACK_BACKEND = "fanfold-loopback"


def default_nproc_per_node() -> int:
    """One worker per GPU, or 2 on a CPU-only machine."""
    import torch

    return torch.cuda.device_count() or 2


def threads_per_worker(nproc_per_node: int) -> int:
    """max(1, usable cores // workers on this node): the cores this process may run on, not the machine's."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc_per_node)


class _LoopbackRendezvous(RendezvousHandler):
    """Rendezvous of a single node: this agent is node 0 of 1, the store's socket listens on 127.0.0.1 only."""

    def __init__(self, run_id: str, timeout: timedelta, secret: bytes):
        self._run_id, self._timeout, self._secret = run_id, timeout, secret
        self._closed = False
        self._store = self._server = None

    def get_backend(self) -> str:
        return _LOOPBACK_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to this store as clients (TORCHELASTIC_USE_AGENT_STORE): no second listener

    def next_rendezvous(self) -> RendezvousInfo:
        # A fresh store for every round: restarted workers must not read the keys of the round that failed.
        self.shutdown_store()
        self._server = loopback_store(self._secret)
        self._store = JobStore(LOOPBACK, self._server.port, self._secret, self._timeout)  # the agent's own client
        return RendezvousInfo(self._store, 0, 1, RendezvousStoreInfo(LOOPBACK, self._server.port))

    def shutdown_store(self) -> None:
        for part in (self._store, self._server):
            if part is not None:
                part.close()
        self._store = self._server = None

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        self.shutdown_store()
        return True


def _create_loopback_handler(params) -> RendezvousHandler:
    # The secret comes from the environment launch_script set up, never from params: torch logs its launch config.
    secret = job_secret()
    if secret is None:
        raise RuntimeError(f"fanfold run: no job secret in the environment ({SECRET_ENV}); launch_script sets one")
    return _LoopbackRendezvous(params.run_id, timedelta(seconds=params.get_as_int("timeout", 900)), secret)


@contextlib.contextmanager
def _environ(changes: Mapping[str, str]) -> Iterator[None]:
    # The agent hands os.environ to the workers (and writes to it itself); put everything back afterwards.
    saved = dict(os.environ)
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def launch_script(
    cmd: Sequence[str],
    *,
    nproc_per_node: int | None = None,
    nnodes: str = "1",
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    rdzv_id: str = "none",
    max_restarts: int = 0,
    module: bool = False,
    extra_env: Mapping[str, str] | None = None,
    verbose: bool = False,
    rank_prefix: bool = False,
) -> int:
    """Run ``python cmd[0] cmd[1:]`` (``python -m`` with ``module=True``) in ``nproc_per_node`` processes; wait.

    Returns the exit code: 0 when every worker succeeded, else non-zero after printing the failed rank and its
    traceback to stderr; no worker is left running. A single node (``nnodes="1"``, no ``rdzv_endpoint``) uses a
    rendezvous on 127.0.0.1; otherwise torch's ``rdzv_backend`` at ``rdzv_endpoint`` (``nnodes`` is "N" or
    "MIN:MAX", ``node_rank`` is read by the static backend only). ``extra_env`` is added to the workers' environment.
    ``verbose`` shows torch's agent log lines and every failed rank's traceback as it happens; without it, one
    report at the end: the rank that failed first, its traceback, the ranks stopped, the exit code. The workers'
    output arrives as whole lines (never two workers within one line); ``rank_prefix`` starts each with
    ``[rank R] ``.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from torch.distributed.run import parse_min_max_nnodes

    cmd = [str(c) for c in cmd]
    if not cmd:
        raise ValueError("no script given; expected a script path and its arguments")
    # before anything starts: a typo or a syntax error costs no worker start-up and reads as one line
    check_module(cmd[0]) if module else check_script(cmd[0])
    if nproc_per_node is None:
        nproc_per_node = default_nproc_per_node()
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be a positive int, got {nproc_per_node!r}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(str(nnodes))
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"nnodes must be 'N' or 'MIN:MAX', got {nnodes!r}") from exc
    if not 0 < min_nodes <= max_nodes:
        raise ValueError(f"nnodes must satisfy 0 < MIN <= MAX, got {nnodes!r}")

    env = {"OMP_NUM_THREADS": str(threads_per_worker(nproc_per_node))} if "OMP_NUM_THREADS" not in os.environ else {}
    single = max_nodes == 1 and not rdzv_endpoint
    if single:
        rendezvous_handler_registry.register(_LOOPBACK_BACKEND, _create_loopback_handler)  # idempotent
        backend, endpoint, run_id, configs = _LOOPBACK_BACKEND, f"{LOOPBACK}:0", uuid.uuid4().hex, {}
        lo = loopback_interface()
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if lo and var not in os.environ:
                env[var] = lo  # the collectives' own listening sockets stay on loopback too
    else:
        if not rdzv_endpoint:
            raise ValueError(f"nnodes={nnodes!r} spans several machines: pass rdzv_endpoint as HOST:PORT")
        backend, endpoint, run_id = rdzv_backend, rdzv_endpoint, rdzv_id
        configs = {"rank": node_rank} if rdzv_backend == "static" else {}
        # A fresh store for the workers of every rendezvous round (rank 0's worker hosts it), not the agents'
        # shared one: its keys are prefixed by each agent's own restart count, and the agents' counts differ
        # after a restart (the node whose worker failed counts one; a node that only saw it rejoin may not), so
        # the restarted workers of one node would read the last round's keys (gloo: connection refused).
        if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(extra_env or {})
    # The user's secret (multi-node: the same on every node) or one made for this run; the workers find it in their
    # environment, which only this user can read, and never on a command line.
    # A multi-node job without the user's secret keeps torch's rendezvous: open to whoever reaches its endpoint.
    if single:
        if job_secret() is None:
            env[SECRET_ENV] = new_secret()
        env[STORE_ENV] = "1"  # MASTER_ADDR:MASTER_PORT is the agent's authenticated store
    elif job_secret() is None:
        print(f"fanfold run: no {SECRET_ENV} or {SECRET_FILE_ENV} set: this multi-node job's rendezvous is open to "
              f"anyone who can reach {rdzv_endpoint} (docs/reliability.md)", file=sys.stderr)
    if verbose:
        env["FANFOLD_VERBOSE"] = "1"
    if rank_prefix:
        env["FANFOLD_RANK_PREFIX"] = "1"

    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_shim.py")
    args = ["-u", shim, *(["-m"] if module else []), *cmd]
    with tempfile.TemporaryDirectory(prefix="fanfold-run-") as logs, _environ(env), _quiet_torch(not verbose), \
            _restart_notices(quiet=not verbose):
        config = LaunchConfig(
            min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node, run_id=run_id,
            rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=configs, max_restarts=max_restarts,
            monitor_interval=0.1, start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=logs),
            local_addr=LOOPBACK if single else None,
        )
        try:
            elastic_launch(config, sys.executable)(*args)
        except ChildFailedError as err:
            print(format_failure(err, verbose=verbose), file=sys.stderr, flush=True)
            return _exit_code(err)
        except SignalException as exc:
            print(f"fanfold run: stopped by {exc.sigval.name}; every worker was stopped", file=sys.stderr)
            return 128 + int(exc.sigval)
    return 0


@contextlib.contextmanager
def _quiet_torch(quiet: bool) -> Iterator[None]:
    # torch's agent logs every SIGTERM it sends and every failure it sees (W/E lines) on loggers with levels of
    # their own; the report at the end says the same once. Restored afterwards: this process may be a user's.
    if not quiet:
        yield
        return
    names = [n for n in list(logging.root.manager.loggerDict)
             if n.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))]
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, saved):
            lg.setLevel(level)


_POLL_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # logs "failed (exitcode: ...) local_rank: ..."
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"  # logs "... attempts left; will restart worker group"


class _RestartNotice(logging.Handler):
    """One line on stderr when the agent restarts the workers: which worker failed, how, and the attempt starting,
    e.g. ``fanfold run: local rank 1 (pid 41) was killed by signal SIGKILL; restarting (attempt 1 of 2)``.

    torch's agent says both things only in its own log records (the first failure, then the restart), which the
    quiet mode hides; the workers' own tracebacks are printed by the shim, labelled with their rank.
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._failure: tuple | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text = record.msg if isinstance(record.msg, str) else ""
        args = record.args if isinstance(record.args, tuple) else ()
        if text.startswith("failed (exitcode") and len(args) >= 3:
            self._failure = args[:3]  # exitcode, local rank, pid
        elif "will restart worker group" in text and "attempts left" in text and len(args) >= 4:
            left, total = int(args[2]), int(args[3])
            what = ""
            if self._failure is not None:
                code, local_rank, pid = self._failure
                how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
                       else f"failed with exit code {code}")
                what = f"local rank {local_rank} (pid {pid}) {how}; "
            self._failure = None
            print(f"fanfold run: {what}restarting (attempt {total - left + 1} of {total})", file=sys.stderr,
                  flush=True)


@contextlib.contextmanager
def _restart_notices(quiet: bool) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in (_POLL_LOGGER, _AGENT_LOGGER)]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    notice = _RestartNotice()
    for lg in loggers:
        lg.setLevel(logging.INFO)
        lg.addHandler(notice)
        if quiet:  # the records reach the notice only, not torch's handlers
            lg.propagate = False
    try:
        yield
    finally:
        for lg, (level, propagate) in zip(loggers, saved):
            lg.removeHandler(notice)
            lg.setLevel(level)
            lg.propagate = propagate


def _time_ns(failure) -> float:
    info = failure.error_file_data.get("message")
    if isinstance(info, dict) and "time_ns" in info.get("extraInfo", {}):
        return int(info["extraInfo"]["time_ns"])
    return failure.timestamp * 1e9 + 1e9  # no error file: after any rank that recorded one in the same second


def _root_cause(err) -> tuple[int, object]:
    return min(err.failures.items(), key=lambda kv: (_time_ns(kv[1]), kv[0]))


def _describe(rank: int, failure) -> str:
    how = (f"was killed by signal {failure.signal_name()}" if failure.exitcode < 0
           else f"failed with exit code {failure.exitcode}")
    return f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"


def format_failure(err, verbose: bool = False) -> str:
    """The report of a failed run, once: the rank that failed first and its full traceback, the ranks stopped, the
    ranks that failed after it (their error type only: usually the first failure's consequence, such as gloo's
    "Connection closed by peer"; ``verbose`` adds their message), and the exit code."""
    rank, first = _root_cause(err)
    info = first.error_file_data.get("message")
    lines = [f"fanfold run: {_describe(rank, first)}"]
    if isinstance(info, dict):
        lines.append(f"Traceback of rank {rank}:")
        lines.append(info["extraInfo"]["py_callstack"].rstrip())
    elif first.exitcode < 0:
        lines.append("no Python traceback: the process was killed (any output it left is above)")
    else:
        lines.append("no Python exception was raised (sys.exit or os._exit with that code; its output is above)")
    stopped, after = [], []
    for other, failure in sorted(err.failures.items()):
        msg = failure.error_file_data.get("message")
        if other == rank:
            continue
        if failure.exitcode == -signal.SIGTERM and not isinstance(msg, dict):
            stopped.append(other)  # the agent's own SIGTERM, sent when the first rank failed
        else:
            text = msg["message"] if isinstance(msg, dict) else ""
            what = (text if verbose else text.split(":", 1)[0]) or _describe(other, failure).split(") ", 1)[1]
            after.append(f"fanfold run: rank {other} also failed, after rank {rank} ({what})")
    if stopped:
        lines.append(f"fanfold run: stopped the other workers (ranks {stopped})")
    lines += after
    lines.append(f"fanfold run: exit code {_exit_code(err)}")
    return "\n".join(lines)


def _exit_code(err) -> int:
    code = _root_cause(err)[1].exitcode
    return code if code > 0 else 128 + (-code or 1)
