"""Each ``fanfold run`` worker: ``python -u worker_shim.py [-m] target args...`` runs the target as ``python`` would,
plus: its uncaught exception with a fanfold error's headline first and fanfold's own frames cut (in full with
``FANFOLD_DEBUG=1``), and in torch's error file; ``faulthandler``, no worker (nor its helpers) outliving the
launcher, ``env://`` routed to the job's store, a ``TCPStore`` client of the job's store refused at once, output in
whole lines. Imports neither torch nor fanfold."""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib.util
import json
import os
import re
import runpy
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback

_LINE_ENDS = re.compile(r"(?<=\n)|(?<=\r)(?!\n)")  # splits after each \n, and after a \r not part of \r\n


class WholeLines:
    """A text stream over ``target`` that writes whole lines only (ended by ``\\n``, or ``\\r`` redrawing a progress
    bar), each started with ``prefix``; ``flush`` keeps an unfinished line back (two ranks' ``print(end="")`` would
    interleave) until :meth:`close_line`. Other attributes are ``target``'s."""

    def __init__(self, target, prefix: str = ""):
        self._target, self._prefix = target, prefix
        self._pending = ""
        self._lock = threading.Lock()  # a worker's threads print too

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            cut = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
            if cut:
                self._emit(self._pending[:cut])
                self._pending = self._pending[cut:]
        return len(text)

    def _emit(self, text: str) -> None:
        if self._prefix:
            text = "".join(self._prefix + line for line in _LINE_ENDS.split(text) if line)
        self._target.write(text)
        self._target.flush()

    def close_line(self) -> None:
        with self._lock:
            if self._pending:
                self._emit(self._pending + "\n")
                self._pending = ""

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def whole_lines(prefix: str = "") -> tuple[WholeLines, WholeLines]:
    """Replace ``sys.stdout`` and ``sys.stderr`` by :class:`WholeLines` over them; returns the two."""
    sys.stdout, sys.stderr = WholeLines(sys.stdout, prefix), WholeLines(sys.stderr, prefix)
    for stream in (sys.stdout, sys.stderr):
        atexit.register(stream.close_line)  # registered first, run last: after the user's own exit handlers
    return sys.stdout, sys.stderr


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except (OSError, UnicodeError):
        return False


def refuse_job_store_clients(tcp_store: type) -> None:
    """Make ``tcp_store`` (torch's ``TCPStore`` class) raise at once, naming what the port is and how to get a store,
    when a process of this job (``FANFOLD_JOB_STORE=1``) opens one at ``MASTER_ADDR:MASTER_PORT``: that port is
    fanfold's authenticated store, whose greeting torch's client takes for a failed ping and retries until its
    timeout (torch retries every network error in its constructor: no answer of the server can stop it sooner)."""
    if os.environ.get("FANFOLD_JOB_STORE") != "1" or getattr(tcp_store.__init__, "fanfold_refuses", False):
        return
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    torch_init = tcp_store.__init__

    def init(self, *args, **kwargs):
        host = args[0] if args else kwargs.get("host_name", "")
        to = args[1] if len(args) > 1 else kwargs.get("port", -1)
        if str(to) == port and isinstance(host, str) and _same_host(host, addr):
            from torch.distributed import DistStoreError

            raise DistStoreError(
                f"MASTER_ADDR:MASTER_PORT ({addr}:{port}) is fanfold's job store, which admits only this job's "
                f"processes proving its secret: torch's TCPStore client cannot use it. For a store all ranks share, "
                f"use `store, rank, world_size = next(torch.distributed.rendezvous(\"env://\"))` (before or "
                f"without init_process_group), or `torch.distributed.distributed_c10d._get_default_store()` after "
                f"init_process_group (docs/launching.md)")
        torch_init(self, *args, **kwargs)

    init.fanfold_refuses = True
    tcp_store.__init__ = init


class _RouteEnvRendezvous:
    """An import hook: once ``torch.distributed.rendezvous`` is imported, the first use of its ``env://`` handler
    installs ``fanfold._core.job.install_env_rendezvous`` (fanfold is imported only then), and a ``TCPStore``
    client of the job's store is refused (:func:`refuse_job_store_clients`)."""

    _NAME = "torch.distributed.rendezvous"

    def find_spec(self, name, path=None, target=None):
        if name != self._NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # torch's source file: its loader has exec_module
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            torch_env = module._rendezvous_handlers["env"]

            def env_handler(url, *args, **kwargs):
                from fanfold._core.job import install_env_rendezvous

                module._rendezvous_handlers["env"] = torch_env
                install_env_rendezvous()  # wraps torch_env; used from now on
                yield from module._rendezvous_handlers["env"](url, *args, **kwargs)

            module._rendezvous_handlers["env"] = env_handler
            refuse_job_store_clients(module.TCPStore)

        spec.loader.exec_module = exec_module
        return spec


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG (Linux; no prctl elsewhere): the agent stops the workers, unless it was SIGKILLed itself
    with contextlib.suppress(OSError, AttributeError, TypeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)


def _stop_own_group() -> None:
    # The agent signals the process groups of running workers only: what an exited worker started would outlive
    # the run. The agent starts each worker in a new session, so stop our group on the way out (only if we lead it).
    if os.name != "posix" or os.getpgid(0) != os.getpid():
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.killpg(0, signal.SIGTERM)


DEBUG_ENV = "FANFOLD_DEBUG"  # "1": a failed worker's traceback in full, fanfold's own frames included
_HIDDEN_NOTE = f"(fanfold's own frames are hidden; {DEBUG_ENV}=1 shows the full traceback)\n"
_CHAIN_DEPTH = 8  # how far down __cause__/__context__ a headline is looked for


def debug_tracebacks() -> bool:
    """Whether ``$FANFOLD_DEBUG`` asks for full tracebacks."""
    return os.environ.get(DEBUG_ENV) == "1"


def headline(exc: BaseException) -> str | None:
    """The one-line diagnosis of a fanfold error (``StallError.headline``) in ``exc`` or the exceptions it chains."""
    seen = 0
    while exc is not None and seen < _CHAIN_DEPTH:
        line = getattr(exc, "headline", None)
        if isinstance(line, str) and line and type(exc).__module__.startswith("fanfold."):
            return line
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


class _Frames:
    """Which frames of a traceback are the launcher's (this shim, runpy, ``fanfold.launch``'s worker), fanfold's,
    plumbing (torch, the standard library) or the user's: by file, under this package's directory (this file is
    ``fanfold/launcher/worker_shim.py``) or torch's."""

    def __init__(self):
        here = os.path.dirname(os.path.realpath(__file__))
        self.launcher, self.package = here + os.sep, os.path.dirname(here) + os.sep
        trees = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
        torch = sys.modules.get("torch")  # never imported here: a script that failed before importing it has none
        if getattr(torch, "__file__", None):
            trees.add(os.path.dirname(torch.__file__))
        self.plumbing = tuple(os.path.realpath(t) + os.sep for t in trees)
        self._kinds: dict[str, str] = {}

    def kind(self, filename: str) -> str:
        kind = self._kinds.get(filename)
        if kind is None:
            path = filename if filename.startswith("<") else os.path.realpath(filename)
            kind = ("launcher" if path.startswith(self.launcher) or "runpy" in filename else
                    "fanfold" if path.startswith(self.package) else
                    "plumbing" if path.startswith(self.plumbing) or filename.startswith("<frozen ") else "user")
            self._kinds[filename] = kind
        return kind

    def cut(self, stack: list, debug: bool) -> tuple[list, bool]:
        """``stack`` (frame summaries, outermost first) as the user reads it, and whether fanfold's frames were cut.
        It starts after the launcher's frames, as ``python script.py`` shows none. Unless ``debug``: without
        fanfold's frames, and ending at the user's last frame when the error came out of fanfold (the torch frames
        that led into fanfold go too, so the last frame is the user's call: ``loss.backward()``, ``model(x)``);
        where no frame is the user's, nothing more is cut."""
        start = 0
        while start < len(stack) - 1 and self.kind(stack[start].filename) == "launcher":
            start += 1
        stack = stack[start:]
        kinds = [self.kind(f.filename) for f in stack]
        users = [i for i, k in enumerate(kinds) if k == "user"]
        if debug or not users:
            return traceback.StackSummary.from_list(stack), False
        last = users[-1]
        kept = [f for f, k in zip(stack[:last + 1], kinds[:last + 1]) if k not in ("fanfold", "launcher")]
        cut_between = len(kept) < last + 1
        into_fanfold = any(k in ("fanfold", "launcher") for k in kinds[last + 1:])
        if not into_fanfold:
            kept += stack[last + 1:]
        return traceback.StackSummary.from_list(kept), cut_between or into_fanfold


def format_traceback(exc: BaseException, debug: bool = False) -> str:
    """``exc``'s traceback as a failed worker shows it, its chained exceptions included. Unless ``debug``:
    fanfold's own frames cut (:meth:`_Frames.cut`); a chained exception raised and caught inside fanfold (no frame
    of the user's) dropped where the message after it names it already (a ``StallError``'s ``cause:`` line), else
    shown without frames; a closing line says what was hidden."""
    frames = _Frames()
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    hidden = False
    step, value, outer = report, exc, None
    for _ in range(64):  # TracebackException's chain ends; bounded all the same
        step.stack, cut = frames.cut(list(step.stack), debug)
        hidden |= cut
        if outer is not None and not debug and not any(frames.kind(f.filename) == "user" for f in step.stack):
            hidden = True
            if type(value).__name__ in str(outer[1]):  # the message that follows carries it: nothing to add
                outer[0].__cause__ = outer[0].__context__ = None
                break
            step.stack = traceback.StackSummary.from_list([])
        outer = (step, value)
        if step.__cause__ is not None:
            step, value = step.__cause__, value.__cause__
        elif step.__context__ is not None and not step.__suppress_context__:
            step, value = step.__context__, value.__context__
        else:
            break
    return "".join(report.format()) + (_HIDDEN_NOTE if hidden else "")


def _record(exc: BaseException, text: str, line: str | None, when_ns: int, gone: list[int] | None) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # time_ns: ProcessFailure keeps whole seconds only; ranks that fail in the same second are told apart by it.
    # peer_gone: this failure is a consequence (the ranks whose process was gone, [] when unknown), never the cause.
    info = {"py_callstack": text, "timestamp": str(when_ns // 10**9), "time_ns": when_ns}
    if line is not None:
        info["headline"] = line
    if gone is not None:
        info["peer_gone"] = gone
    # Written aside and renamed into place: the agent may SIGTERM this rank while it writes, and torch's agent
    # reads the file with json.load, which raises on a half-written one (the whole run's report lost).
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "w") as fp:
            json.dump({"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": info}}, fp)
        os.replace(part, path)
    except OSError as err:
        print(f"fanfold run: cannot write the error file {path}: {err}", file=sys.stderr)


# A rank whose peer died fails in its next collective with gloo's or the store's "connection closed" errors, or
# fanfold's StallError naming the dead peer: the consequence, not the cause (the cause is the peer's own traceback,
# or the launcher's line on how it died). Text too: an exception that crossed torch's C++ keeps its message only.
# gloo's words for a socket a dead peer closed (its own texts and the OS's, in either case: gloo writes "connection
# reset by peer" too), including "Socket closed" for an operation on a pair that an earlier one found closed, and a
# connection refused by a peer whose listening socket is gone; fanfold's store client's error type.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed",
              "connection refused", "distnetworkerror")
_GONE_RANK = re.compile(r"rank (\d+)'s process \d+ is gone|rank (\d+): [^\n]*its process \d+ is gone|rank (\d+) died")


def peers_gone(exc: BaseException) -> list[int] | None:
    """The ranks whose process was gone when ``exc`` (or an exception it was raised from or while handling) was
    raised, ``[]`` when a peer is gone but not known by rank; None: not a dead peer's consequence."""
    found, seen = None, set()
    while exc is not None and id(exc) not in seen and len(seen) < 16:
        seen.add(id(exc))
        text = f"{type(exc).__name__}: {exc}"
        ranks = list(getattr(exc, "gone", None) or ()) or [int(a or b or c) for a, b, c in _GONE_RANK.findall(text)]
        if ranks:
            return sorted(set(ranks))
        if any(s in text.lower() for s in _PEER_GONE):
            found = []
        exc = exc.__cause__ or exc.__context__
    return found


def _own_report(exc: BaseException, text: str, gone: list[int] | None) -> str:
    # The launcher shows the traceback of the rank that failed first once the run has failed; a failure the agent
    # restarts from is labelled here; --verbose shows every rank's.
    verbose = os.environ.get("FANFOLD_VERBOSE") == "1"
    done, allowed = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    if done >= allowed:
        return text if verbose else ""
    rank, label = os.environ["RANK"], f"restarting (attempt {done + 1} of {allowed})"
    if not verbose and gone is not None:
        return (f"fanfold run: rank {rank} also failed: a peer is gone ({type(exc).__name__}); {label} "
                f"(--verbose shows its traceback)\n")
    return f"fanfold run: rank {rank} failed; {label}. Traceback of rank {rank}:\n{text}"


def main(argv: list[str]) -> int:
    module = argv[:1] == ["-m"]  # launch_script passes [-m] target args...
    sys.argv = argv[module:]
    target = sys.argv[0]
    prefix = f"[rank {os.environ.get('RANK', '?')}] " if os.environ.get("FANFOLD_RANK_PREFIX") == "1" else ""
    streams = whole_lines(prefix)
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    _die_with_parent()
    if os.environ.get("FANFOLD_JOB_SECRET") or os.environ.get("FANFOLD_JOB_SECRET_FILE"):
        sys.meta_path.insert(0, _RouteEnvRendezvous())
    try:
        if module:
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # KeyboardInterrupt too: the launcher reports it like any other failure
        when_ns = time.time_ns()  # before the formatting: which rank failed first is told by this
        # As python does for an uncaught exception: the exception and its frames live until the interpreter exits.
        # Freed here instead, a collective's last Python reference to a failed torch work can go first, and the
        # backend's thread then frees the work's tensors during finalization: torch aborts the worker (SIGABRT).
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        try:
            text, line = format_traceback(exc, debug_tracebacks()), headline(exc)
        except Exception:  # noqa: BLE001 - the failure must be reported, if not as fanfold would show it
            text, line = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), None
        gone = peers_gone(exc)
        sys.stderr.write(_own_report(exc, text if line is None else f"fanfold: {line}\n{text}", gone))
        sys.stderr.flush()
        _record(exc, text, line, when_ns, gone)
        return 1
    finally:
        for stream in streams:
            stream.close_line()
        _stop_own_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
