"""Each ``fanfold run`` worker: ``python -u worker_shim.py [-m] target args...`` runs the target as ``python`` would,
plus: its uncaught exception in torch's error file, ``faulthandler``, no worker (nor its helpers) outliving the
launcher, ``env://`` routed to the job's store, output in whole lines. Imports neither torch nor fanfold."""
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
import sys
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


class _RouteEnvRendezvous:
    """An import hook: once ``torch.distributed.rendezvous`` is imported, the first use of its ``env://`` handler
    installs ``fanfold._core.job.install_env_rendezvous`` (fanfold is imported only then)."""

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


def _user_frames(tb):
    # Drop the shim's and runpy's frames so the traceback starts in the user's code, as with `python script.py`.
    here = os.path.abspath(__file__)
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if os.path.abspath(name) != here and "runpy" not in name:
            break
        tb = tb.tb_next
    return tb


def _record(exc: BaseException, text: str, gone: list[int] | None) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # time_ns: ProcessFailure keeps whole seconds only; ranks that fail in the same second are told apart by it.
    # peer_gone: this failure is a consequence (the ranks whose process was gone, [] when unknown), never the cause.
    info = {"py_callstack": text, "timestamp": str(int(time.time())), "time_ns": time.time_ns()}
    if gone is not None:
        info["peer_gone"] = gone
    try:
        with open(path, "w") as fp:
            json.dump({"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": info}}, fp)
    except OSError as err:
        print(f"fanfold run: cannot write the error file {path}: {err}", file=sys.stderr)


# A rank whose peer died fails in its next collective with gloo's or the store's "connection closed" errors, or
# fanfold's StallError naming the dead peer: the consequence, not the cause (the cause is the peer's own traceback,
# or the launcher's line on how it died). Text too: an exception that crossed torch's C++ keeps its message only.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistNetworkError")
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
        if any(s in text for s in _PEER_GONE):
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
        # As python does for an uncaught exception: the exception and its frames live until the interpreter exits.
        # Freed here instead, a collective's last Python reference to a failed torch work can go first, and the
        # backend's thread then frees the work's tensors during finalization: torch aborts the worker (SIGABRT).
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        text = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__)))
        gone = peers_gone(exc)
        sys.stderr.write(_own_report(exc, text, gone))
        sys.stderr.flush()
        _record(exc, text, gone)
        return 1
    finally:
        for stream in streams:
            stream.close_line()
        _stop_own_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
