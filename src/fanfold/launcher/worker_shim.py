"""The shim each rank of ``fanfold run`` executes: ``python -u _worker.py [-m] target args...``.

Runs the user's script (or module, with ``-m``) as ``__main__`` exactly as ``python script.py args`` would (same
``sys.argv``, ``sys.path[0]`` = the script's folder), and adds three things torchrun leaves to the user:

- an uncaught exception is written to the error file the elastic agent names in ``TORCHELASTIC_ERROR_FILE`` (the
  JSON layout of torch's ``ErrorHandler``, read back by ``ProcessFailure``), minus this shim's frames, so the
  launcher can show which rank failed first and its full traceback, once; it is printed here as well only when the
  launcher will not show it (a failure the agent restarts from, no error file) or with ``FANFOLD_VERBOSE=1``;
- ``faulthandler`` is on, so a segfault still leaves a Python stack on stderr;
- on Linux the worker is killed when the launcher dies, even by SIGKILL, so no worker outlives it; and when the
  worker ends, the processes it started in its process group (helpers, servers, pools) are stopped with it.

Deliberately imports neither torch nor fanfold: a script that does not need them starts in milliseconds.
"""
from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: the agent stops workers on every exit it sees, but a SIGKILLed agent sees nothing.
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _stop_own_group() -> None:
    # The agent signals the process groups of workers still running; a worker that has exited (failed or done)
    # is skipped, and what it started would outlive the run. We lead our group (the agent starts each worker in a
    # new session), so stop the group's other members on the way out. Never when started otherwise: the group
    # would be the caller's.
    if os.name != "posix" or os.getpgid(0) != os.getpid():
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(0, signal.SIGTERM)
    except OSError:
        pass


def _user_frames(tb):
    # Drop the shim's and runpy's frames so the traceback starts in the user's code, as with `python script.py`.
    here = os.path.abspath(__file__)
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if os.path.abspath(name) != here and "runpy" not in name:
            break
        tb = tb.tb_next
    return tb


def _record(exc: BaseException, text: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": text,
                "timestamp": str(int(time.time())),
                # ProcessFailure keeps whole seconds only; ranks that fail in the same second are told apart by this.
                "time_ns": time.time_ns(),
            },
        }
    }
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError as err:
        print(f"fanfold run: cannot write the error file {path}: {err}", file=sys.stderr)


def _launcher_wont_show() -> bool:
    # The launcher prints the traceback of the rank that failed first once the run has failed; a failure the agent
    # restarts from is never reported by it, and --verbose (FANFOLD_VERBOSE) shows every rank's as it happens.
    if not os.environ.get("TORCHELASTIC_ERROR_FILE") or os.environ.get("FANFOLD_VERBOSE") == "1":
        return True
    try:
        return int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    except (KeyError, ValueError):
        return True


def main(argv: list[str]) -> int:
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        print("usage: _worker.py [-m] target [args...]", file=sys.stderr)
        return 2
    target = argv[0]
    sys.argv = list(argv)
    faulthandler.enable(all_threads=True)
    _die_with_parent()
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
        text = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__)))
        if _launcher_wont_show():
            sys.stderr.write(text)
            sys.stderr.flush()
        _record(exc, text)
        return 1
    finally:
        _stop_own_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
