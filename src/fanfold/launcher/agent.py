"""``fanfold run`` and ``launch_script``: N workers of a script on torch's elastic agent (torchrun's environment,
rendezvous and restarts), plus: the target checked before any worker starts, a single node's rendezvous on
127.0.0.1 behind the job's secret, and one report that blames the root cause. docs/launching.md."""
from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import os
import signal
import sys
import tempfile
import time
import unittest.mock
import uuid
import zipfile
from collections.abc import Iterator, Mapping, Sequence

import torch

from .._core.job import SECRET_ENV, SECRET_FILE_ENV, STORE_ENV, job_secret, new_secret
from .._core.stall_timeout import ENV_VAR as STALL_TIMEOUT_ENV
from .._core.stall_timeout import resolve_stall_timeout
from .blame import Blame, blame, error_info
from .spawn import LOOPBACK, later_failures, loopback_env


def default_nproc_per_node() -> int:
    """One worker per GPU, or 2 on a CPU-only machine."""
    return torch.cuda.device_count() or 2


def threads_per_worker(nproc_per_node: int) -> int:
    """max(1, usable cores // workers on this node): the cores this process may run on, not the machine's."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc_per_node)


def _compiles(path: str, what: str) -> None:
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        raise ValueError(f"{what} cannot be read: {exc.strerror}") from None
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:  # IndentationError too
        where = f"line {exc.lineno}" + (f": {exc.text.strip()!r}" if exc.text and exc.text.strip() else "")
        raise ValueError(f"{what} does not compile: {type(exc).__name__}: {exc.msg} ({where})") from None
    except ValueError as exc:  # null bytes in the source
        raise ValueError(f"{what} does not compile: {exc}") from None


def check_script(script: str) -> None:
    """ValueError unless ``python script`` could start: a Python file that compiles, or a directory or zip file
    with a ``__main__.py``."""
    if not os.path.exists(script):
        raise ValueError(f"script not found: {script!r}")
    if os.path.isdir(script):
        main = os.path.join(script, "__main__.py")
        if not os.path.isfile(main):
            raise ValueError(f"script {script!r} is a directory without a __main__.py: give the Python file to run "
                             f"(or the package with -m)")
        script = main
    elif not os.path.isfile(script):
        raise ValueError(f"script {script!r} is not a regular file")
    if not zipfile.is_zipfile(script):  # a zip application is checked by the interpreter that opens it
        _compiles(script, f"script {script!r}")


def _find(name: str, path: list[str] | None):
    # without importing anything: the path finder, then (a top-level name) the other finders (an editable install's)
    finders = [(importlib.machinery.PathFinder, path)]
    if "." not in name:
        finders += [(f, None) for f in sys.meta_path if f is not finders[0][0] and hasattr(f, "find_spec")]
    for finder, where in finders:
        with contextlib.suppress(Exception):  # a third-party finder that cannot answer without importing
            spec = finder.find_spec(name, where)
            if spec is not None:
                return spec
    return None


def check_module(module: str) -> None:
    """ValueError unless ``python -m module`` could start from this directory, found without running any package's
    ``__init__``; a source file must compile."""
    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ValueError(f"module {module!r} is not a dotted Python name (to run a file, leave -m out)")
    # a worker runs with the current directory first on sys.path (python -m's rule), then the rest of ours
    search: list[str] | None = [os.getcwd(), *sys.path[1:]]
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        spec = _find(name, search)
        if spec is None:
            where = "" if i == 0 else f" (package {'.'.join(parts[:i])!r} has no {parts[i]!r})"
            raise ValueError(f"module not found: {module!r}{where}; run from the directory that holds it, or "
                             f"put that directory on PYTHONPATH")
        search = list(spec.submodule_search_locations or [])
        if i < len(parts) - 1 and spec.submodule_search_locations is None:
            raise ValueError(f"module not found: {module!r} ({name!r} is a module, not a package)")
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        spec = _find(f"{module}.__main__", search)
        if spec is None:
            raise ValueError(f"module {module!r} is a package without a __main__ module: python -m cannot run it")
    if spec.origin and spec.origin.endswith(".py") and os.path.isfile(spec.origin):
        _compiles(spec.origin, f"module {spec.name!r} ({spec.origin})")


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
    stall_timeout: float | None = None,
) -> int:
    """Run ``python cmd[0] cmd[1:]`` (``python -m`` with ``module=True``) in ``nproc_per_node`` processes; wait.
    Returns 0 when every worker succeeded; else prints the root cause (the rank that failed first on its own, not
    one that failed because a peer was gone, nor one the agent stopped) with its traceback to stderr and returns its
    exit code; no worker is left running. ``nnodes`` ("N" or "MIN:MAX") of 1 without ``rdzv_endpoint``
    is a rendezvous on 127.0.0.1; more use torch's ``rdzv_backend`` at ``rdzv_endpoint`` (``node_rank``: read by
    the static backend only). ``extra_env`` is added to the workers' environment. ``verbose`` shows torch's agent
    log and every failed rank's traceback as it happens. Output arrives in whole lines; ``rank_prefix`` starts each
    with ``[rank R] ``. ``stall_timeout``: seconds the workers' fanfold collectives wait for a peer
    (``FANFOLD_STALL_TIMEOUT``; default: that variable's value here, else 300).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from torch.distributed.run import parse_min_max_nnodes

    from .loopback import BACKEND as _LOOPBACK_BACKEND
    from .loopback import LoopbackRendezvous

    cmd = [str(c) for c in cmd]
    if not cmd:
        raise ValueError("no script given; expected a script path and its arguments")
    if nproc_per_node is None:
        nproc_per_node = default_nproc_per_node()
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node!r}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if stall_timeout is not None:
        stall_timeout = resolve_stall_timeout(stall_timeout)  # ValueError naming stall_timeout
    elif os.environ.get(STALL_TIMEOUT_ENV):  # the workers' value: refused here once, not in every worker
        resolve_stall_timeout()
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(str(nnodes))
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"nnodes must be 'N' or 'MIN:MAX', got {nnodes!r}") from exc
    if not 0 < min_nodes <= max_nodes:
        raise ValueError(f"nnodes must satisfy 0 < MIN <= MAX, got {nnodes!r}")
    # before anything starts: a typo or a syntax error costs no worker start-up and reads as one line
    check_module(cmd[0]) if module else check_script(cmd[0])

    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_worker(nproc_per_node))),
           "FANFOLD_VERBOSE": str(int(verbose)), "FANFOLD_RANK_PREFIX": str(int(rank_prefix))}
    if stall_timeout is not None:
        env[STALL_TIMEOUT_ENV] = repr(stall_timeout)
    single = max_nodes == 1 and not rdzv_endpoint
    if single:
        rendezvous_handler_registry.register(_LOOPBACK_BACKEND, LoopbackRendezvous)  # idempotent
        backend, endpoint, run_id, configs = _LOOPBACK_BACKEND, f"{LOOPBACK}:0", uuid.uuid4().hex, {}
        env.update(loopback_env())
        if job_secret() is None:  # the workers find it in their environment, never on a command line
            env[SECRET_ENV] = new_secret()
        env[STORE_ENV] = "1"  # MASTER_ADDR:MASTER_PORT is the agent's authenticated store
    else:
        if not rdzv_endpoint:
            raise ValueError(f"nnodes={nnodes!r} spans several machines: pass rdzv_endpoint as HOST:PORT")
        backend, endpoint, run_id = rdzv_backend, rdzv_endpoint, rdzv_id
        configs = {"rank": node_rank} if rdzv_backend == "static" else {}
        # The workers' store fresh every round, not the agents' shared one, whose keys carry each agent's own
        # restart count: the counts differ after a restart, and restarted workers would read a stale round's keys.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if job_secret() is None:
            print(f"fanfold run: no {SECRET_ENV} or {SECRET_FILE_ENV} set: this multi-node job's rendezvous is open "
                  f"to anyone who can reach {rdzv_endpoint} (docs/reliability.md)", file=sys.stderr)
    env.update(extra_env or {})
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_shim.py")
    args = ["-u", shim, *(["-m"] if module else []), *cmd]
    # The agent hands os.environ to the workers (and writes to it itself): patch.dict puts everything back.
    with (tempfile.TemporaryDirectory(prefix="fanfold-run-") as logs, unittest.mock.patch.dict(os.environ, env),
          _torch_logs(quiet=not verbose) as records):
        config = LaunchConfig(
            min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node, run_id=run_id,
            rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=configs, max_restarts=max_restarts,
            monitor_interval=0.1, start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=logs),
            local_addr=LOOPBACK if single else None,
        )
        try:
            elastic_launch(config, sys.executable)(*args)
        except ChildFailedError as err:
            found = blame(err, records.stopped)
            print(format_failure(err, verbose=verbose, found=found), file=sys.stderr, flush=True)
            return found.exit_code
        except SignalException as exc:
            print(f"fanfold run: stopped by {exc.sigval.name}; every worker was stopped", file=sys.stderr)
            return 128 + int(exc.sigval)
        except ValueError as exc:  # a ValueError of launch_script is a bad argument (the CLI says which flag): not this
            raise RuntimeError(f"torch's elastic agent failed while it ran the workers: {exc!r}") from exc
    return 0


_POLL_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # logs "failed (exitcode: ...) local_rank: ..."
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"  # logs "... attempts left; will restart worker group"


class _AgentRecords(logging.Handler):
    """What the launcher learns from torch's agent log records: one line on stderr per restart, from the two records
    of a failure and its restart, e.g. ``fanfold run: local rank 1 (pid 41) was killed by signal SIGKILL; restarting
    (attempt 1 of 2)``; and the workers the agent stopped itself (``stopped``: pid -> time.time_ns() of its signal),
    which are never a failure's cause."""

    def __init__(self):
        super().__init__()
        self._failure: tuple | None = None  # (exit code, local rank, pid) of the failure the agent will restart from
        self.stopped: dict[int, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.msg if isinstance(record.msg, str) else ""
        args = record.args if isinstance(record.args, tuple) else ()
        if text.startswith(("Sending process", "Unable to shutdown process")) and args:  # SIGTERM, then SIGKILL
            with contextlib.suppress(TypeError, ValueError):
                self.stopped.setdefault(int(args[0]), time.time_ns())
        elif text.startswith("failed (exitcode") and len(args) >= 3:
            self._failure = args[:3]  # exitcode, local rank, pid
        elif "will restart worker group" in text and "attempts left" in text and len(args) >= 4:
            left, total = int(args[2]), int(args[3])
            code, local_rank, pid = self._failure or (0, 0, 0)
            what = f"local rank {local_rank} (pid {pid}) {_how(code)}; " if self._failure else ""
            self._failure = None
            print(f"fanfold run: {what}restarting (attempt {total - left + 1} of {total})", file=sys.stderr,
                  flush=True)


@contextlib.contextmanager
def _torch_logs(quiet: bool) -> Iterator[_AgentRecords]:
    # Quiet: torch's loggers (levels of their own) log each SIGTERM and failure that the final report sums up once;
    # the agent's records reach the notice either way. Restored afterwards: this process may be a user's.
    names = [n for n in list(logging.root.manager.loggerDict)
             if quiet and n.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))]
    loggers = [logging.getLogger(n) for n in {*names, _POLL_LOGGER, _AGENT_LOGGER}]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    notice = _AgentRecords()
    for lg in loggers:
        if lg.name in (_POLL_LOGGER, _AGENT_LOGGER):
            lg.setLevel(logging.INFO)
            lg.addHandler(notice)
            lg.propagate = lg.propagate and not quiet  # quiet: the records reach the notice only
        else:
            lg.setLevel(logging.CRITICAL)
    try:
        yield notice
    finally:
        for lg, (level, propagate) in zip(loggers, saved):
            lg.removeHandler(notice)
            lg.setLevel(level)
            lg.propagate = propagate


def _how(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by signal {signal.Signals(-exitcode).name}"
    return f"failed with exit code {exitcode}"


def format_failure(err, verbose: bool = False, found: Blame | None = None) -> str:
    """The report of a failed run (a ``ChildFailedError``; ``found``: its :func:`blame`, by default without the
    agent's records): the root cause with its traceback, the ranks that failed because a peer was gone, the ranks
    stopped, the ranks that failed on their own after it (their error type; ``verbose``: their message), the exit
    code."""
    found = found or blame(err)
    rank, first = found.root, found.failure
    info = error_info(first)
    lines = [f"fanfold run: rank {rank} (local rank {first.local_rank}, pid {first.pid}) {_how(first.exitcode)}"]
    if info is not None:
        if info["extraInfo"].get("headline"):  # a fanfold diagnosis: before the traceback that ends with its details
            lines.append(f"fanfold: {info['extraInfo']['headline']}")
        lines += [f"Traceback of rank {rank}:", info["extraInfo"]["py_callstack"].rstrip()]
    elif first.exitcode < 0:
        lines.append("no Python traceback: the process was killed (any output it left is above)")
    else:
        lines.append("no Python exception was raised (sys.exit or os._exit with that code; its output is above)")

    def what(other: int) -> str:
        failure = err.failures[other]
        msg = error_info(failure)
        text = failure.error_file_data["message"]["message"] if msg is not None else ""
        return (text if verbose else text.split(":", 1)[0]) or _how(failure.exitcode)

    consequences = {r: (peers, what(r)) for r, peers in found.consequences.items()}
    later = {r: what(r) for r in found.later}
    lines += later_failures("fanfold run", rank, found.stopped, later, consequences)
    lines.append(f"fanfold run: exit code {found.exit_code}")
    return "\n".join(lines)
