"""Runs the docs' python blocks for snippets.py: reads them as JSON on stdin, imports torch and fanfold once, forks a
child per block (in its own process group and empty directory, bounded by the timeout) and prints one JSON line per
block. The parent runs no tensor op before forking, so each child starts with torch as a fresh import leaves it."""
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback

import torch  # noqa: F401  (imported once, before the forks)

import fanfold


def _script(path: str) -> None:
    runpy.run_path(path, run_name="__main__")


def _child(snippet: dict, directory: str, timeout: float) -> None:
    os.setpgid(0, 0)
    os.chdir(directory)
    out = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.argv = ["block.py"]
    code = 0
    try:
        if snippet["nprocs"]:
            fanfold.launch(_script, os.path.abspath("block.py"), nprocs=snippet["nprocs"], timeout=timeout)
        else:
            _script("block.py")
    except SystemExit as e:  # as the interpreter would: a message to stderr, status 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _one(snippet: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="docscheck-") as directory:
        with open(os.path.join(directory, "block.py"), "w") as f:
            f.write(snippet["code"])
        pid = os.fork()
        if pid == 0:
            _child(snippet, directory, timeout)
        try:
            os.setpgid(pid, pid)  # also here: the kill below must not race the child's own setpgid
        except (PermissionError, ProcessLookupError):
            pass
        deadline, status = time.monotonic() + timeout, None
        while status is None:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
            elif time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = "timeout"
            else:
                time.sleep(0.05)
        try:
            os.killpg(pid, signal.SIGKILL)  # workers of a launch the block left behind
        except ProcessLookupError:
            pass
        with open(os.path.join(directory, "output.txt"), errors="replace") as f:
            output = f.read()
    ok = status == 0
    error = (f"timed out after {timeout:.0f} s" if status == "timeout" else
             f"exit status {os.waitstatus_to_exitcode(status)}") if not ok else ""
    return {"page": snippet["page"], "line": snippet["line"], "ok": ok,
            "error": f"{error}; output:\n{output[-2500:]}" if error else ""}


def main() -> None:
    request = json.load(sys.stdin)
    for snippet in request["snippets"]:
        print(json.dumps(_one(snippet, request["timeout"])), flush=True)


if __name__ == "__main__":
    main()
