"""`fanfold run`: real launcher processes on scripts written to tmp_path, plus the report and argument logic.

Each launch costs a few seconds (torch import), so one launch checks many things: the env contract, pass-through
arguments, the default -n, the threads per worker, the loopback-only listeners and a restart; another checks a
crashing rank (its traceback on the console, non-zero exit, every worker and grandchild gone).
"""
from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from argparse import ArgumentParser
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from _net import listening_addresses
from fanfold.cli import run as run_cli
from fanfold.launcher import agent as launcher
from fanfold.launcher.blame import blame

TIMEOUT = 240  # the CPU is shared with other test runs: generous, never relied on


def _env() -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RANK", "WORLD_SIZE"):
        env.pop(var, None)
    return env


def _run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fanfold", "run", *argv], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has exited; only its parent's wait is missing


def _wait_gone(pids: list[int], seconds: float = 30.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


PROBE = textwrap.dedent("""
    import json, os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist

    {listening_source}
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    report = {"argv": sys.argv, "sum": t.item(), "threads": torch.get_num_threads(),
              "env": {k: os.environ.get(k) for k in keys},
              # the worker's own sockets (gloo) and its parent's, the agent hosting the store
              "listening": listening_addresses(os.getpid()) + listening_addresses(os.getppid())}
    with open(f"rank{dist.get_rank()}.attempt{attempt}.json", "w") as f:
        json.dump(report, f)
    if attempt == "0" and dist.get_rank() == 1:
        raise RuntimeError("planned failure of rank 1")
""")


def test_env_contract_args_threads_loopback_and_restart(tmp_path):
    import torch

    (tmp_path / "probe.py").write_text(PROBE.replace("{listening_source}\n", inspect.getsource(listening_addresses)))
    script_args = ["--lr", "0.1", "-n", "5", "--nnodes=3", "-m", "x y", "--", "last"]
    res = _run(tmp_path, "--max-restarts", "1", "probe.py", *script_args)  # no -n: the default
    assert res.returncode == 0, res.stderr
    n = torch.cuda.device_count() or 2
    threads = max(1, len(os.sched_getaffinity(0)) // n)
    for attempt in (0, 1):
        reports = [json.loads((tmp_path / f"rank{r}.attempt{attempt}.json").read_text()) for r in range(n)]
        assert len({r["env"]["MASTER_PORT"] for r in reports}) == 1
        for rank, rep in enumerate(reports):
            assert rep["argv"] == ["probe.py", *script_args]
            assert rep["sum"] == n * (n + 1) / 2
            assert rep["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                                  "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": reports[0]["env"]["MASTER_PORT"], "OMP_NUM_THREADS": str(threads)}
            assert rep["threads"] == threads
            # 127.0.0.1 in /proc/net/tcp's byte order; nothing on 0.0.0.0 or ::
            assert rep["listening"] and set(rep["listening"]) == {"0100007F"}, rep["listening"]
    assert "RuntimeError: planned failure of rank 1" in res.stderr  # attempt 0's traceback, then the restart
    # labelled: the rank, and which attempt starts (the shim), then how the worker ended (the launcher)
    assert "fanfold run: rank 1 failed; restarting (attempt 1 of 1). Traceback of rank 1:\n" in res.stderr
    assert re.search(r"^fanfold run: local rank 1 \(pid \d+\) failed with exit code 1; restarting \(attempt 1 of 1\)$",
                     res.stderr, re.M), res.stderr
    assert "Connection closed" not in res.stderr and "GLHF" not in res.stderr


CRASH = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = os.environ["RANK"]

    def crash_here():
        raise ValueError(f"boom from rank {rank}")

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(f"pid{rank}.tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(f"pid{rank}.tmp", f"pid{rank}")
    while not all(os.path.exists(f"pid{r}") for r in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.05)
    if rank == "1":
        crash_here()
    time.sleep(300)
""")


def test_crashing_rank_shows_its_traceback_and_leaves_no_process(tmp_path):
    (tmp_path / "crash.py").write_text(CRASH)
    res = _run(tmp_path, "-n", "3", "crash.py")
    assert res.returncode == 1
    pid = int((tmp_path / "pid1").read_text().split()[0])
    # The whole of stderr: the report once, no torch agent log line, no second copy of the traceback.
    assert res.stderr.splitlines() == [
        f"fanfold run: rank 1 (local rank 1, pid {pid}) failed with exit code 1",
        "Traceback of rank 1:",
        "Traceback (most recent call last):",
        '  File "crash.py", line 15, in <module>',
        "    crash_here()",
        '  File "crash.py", line 6, in crash_here',
        '    raise ValueError(f"boom from rank {rank}")',
        "ValueError: boom from rank 1",
        "fanfold run: stopped the other workers (ranks [0, 2])",
        "fanfold run: exit code 1",
    ], res.stderr
    pids = [int(p) for r in range(3) for p in (tmp_path / f"pid{r}").read_text().split()]
    assert _wait_gone(pids) == []


COLLATERAL = textwrap.dedent("""
    import time
    from datetime import timedelta
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if dist.get_rank() == 1:
        time.sleep(0.3)
        raise ValueError("user error on rank 1")
    dist.all_reduce(torch.ones(1))
""")


def test_peer_broken_by_the_failure_is_not_shown_as_its_cause(tmp_path):
    (tmp_path / "collateral.py").write_text(COLLATERAL)
    res = _run(tmp_path, "-n", "2", "collateral.py")
    assert res.returncode == 1
    lines = res.stderr.splitlines()
    assert lines[0].startswith("fanfold run: rank 1 (local rank 1, pid ") and lines[0].endswith("exit code 1")
    assert lines[1:3] == ["Traceback of rank 1:", "Traceback (most recent call last):"]
    assert "ValueError: user error on rank 1" in lines
    assert res.stderr.count("Traceback (most recent call last)") == 1
    assert "GLHF" not in res.stderr and "Connection closed" not in res.stderr
    assert "Fatal Python error" not in res.stderr  # rank 0 exits as python would, not aborted in finalization
    # rank 0 either raised gloo's error because rank 1 was gone (a consequence, named by its type only) or was
    # stopped by the agent; never reported as a failure of its own
    assert lines[-2] in ("fanfold run: rank 0: a peer is gone (RuntimeError)",
                         "fanfold run: rank 0: its peer rank 1 is gone (RuntimeError)",
                         "fanfold run: stopped the other workers (ranks [0])"), res.stderr
    assert "also failed" not in res.stderr
    assert lines[-1] == "fanfold run: exit code 1"
    verbose = _run(tmp_path, "-n", "2", "--verbose", "collateral.py")
    assert verbose.returncode == 1
    assert verbose.stderr.count("ValueError: user error on rank 1") >= 2  # as it happened, and in the report
    assert any(ln[:1] in "WE" and "torch/distributed/elastic" in ln for ln in verbose.stderr.splitlines())


LAST = textwrap.dedent("""
    import atexit, sys
    atexit.register(lambda: open("last", "a").write(f"{sys.last_value!r} {sys.last_traceback is not None}\\n"))
    raise ValueError("kept")
""")


def test_failed_script_keeps_its_exception_until_exit_as_python_does(tmp_path):
    # Python keeps an uncaught exception, and so its frames, in sys.last_value until it exits. Without that, a
    # collective's failed work could be freed on torch's thread during finalization: the worker aborted (SIGABRT).
    (tmp_path / "last.py").write_text(LAST)
    plain = subprocess.run([sys.executable, "last.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1
    oracle = (tmp_path / "last").read_text()
    assert oracle == "ValueError('kept') True\n", oracle
    (tmp_path / "last").unlink()
    res = _run(tmp_path, "-n", "1", "last.py")
    assert res.returncode == 1, res.stderr
    assert (tmp_path / "last").read_text() == oracle


SLEEPER = textwrap.dedent("""
    import os, time
    with open(f"pid{os.environ['RANK']}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
""")


def test_killed_launcher_takes_its_workers_along(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    # a SIGKILLed launcher cannot remove its temporary log directory: keep it inside tmp_path, not in /tmp
    (tmp_path / "tmp").mkdir()
    env = {**_env(), "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.Popen([sys.executable, "-m", "fanfold", "run", "-n", "2", "sleeper.py"], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        time.sleep(0.2)  # let both pid files be written in full
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        proc.send_signal(signal.SIGKILL)  # the agent gets no chance to stop anything
        proc.wait(30)
        assert _wait_gone(pids) == []
        assert [p.name[:12] for p in (tmp_path / "tmp").iterdir()] == ["fanfold-run-"]  # what it left is here
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None = None, time_ns: int = 0) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    if message is not None:
        info = {"py_callstack": f"Traceback (most recent call last):\n{message}\n", "timestamp": "1700000000",
                "time_ns": time_ns}
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_report_names_the_first_failure_by_time_not_by_rank(tmp_path):
    # Same second: ProcessFailure's own timestamps tie; the shim's nanoseconds decide. SIGTERMed ranks are listed.
    err = ChildFailedError("x", {
        0: _failure(tmp_path, 0, 1, "RuntimeError: connection closed by peer", time_ns=2_000),
        1: _failure(tmp_path, 1, 3, "ValueError: the real cause", time_ns=1_000),
        2: _failure(tmp_path, 2, -int(signal.SIGTERM)),
    })
    text = launcher.format_failure(err)
    assert text.splitlines()[0] == "fanfold run: rank 1 (local rank 1, pid 1001) failed with exit code 3"
    assert "ValueError: the real cause" in text
    assert text.splitlines()[-3:] == ["fanfold run: stopped the other workers (ranks [2])",
                                      "fanfold run: rank 0 also failed, after rank 1 (RuntimeError)",
                                      "fanfold run: exit code 3"]
    assert "connection closed" not in text
    assert "rank 0 also failed, after rank 1 (RuntimeError: connection closed by peer)" in launcher.format_failure(
        err, verbose=True)
    assert blame(err).exit_code == 3
    killed = ChildFailedError("x", {0: _failure(tmp_path, 0, -int(signal.SIGKILL))})
    assert "killed by signal SIGKILL" in launcher.format_failure(killed)
    assert blame(killed).exit_code == 128 + int(signal.SIGKILL)


def test_arguments_pass_through_and_bad_values_are_named(tmp_path):
    parser = ArgumentParser()
    run_cli.add_arguments(parser)
    args = parser.parse_args(["-n", "4", "--max-restarts", "2", "train.py", "--lr", "0.1", "-n", "5", "-m", "-h"])
    assert (args.nproc_per_node, args.max_restarts, args.module, args.script) == (4, 2, False, "train.py")
    assert args.script_args == ["--lr", "0.1", "-n", "5", "-m", "-h"]
    assert parser.parse_args(["-m", "pkg.mod"]).module
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ValueError, match="^script not found: 'missing.py'$"):
        launcher.launch_script(["missing.py"])
    with pytest.raises(ValueError, match="nproc_per_node"):
        launcher.launch_script([str(script)], nproc_per_node=0)
    with pytest.raises(ValueError, match="nnodes"):
        launcher.launch_script([str(script)], nnodes="2:1")
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        launcher.launch_script([str(script)], nnodes="2")
    assert launcher.threads_per_worker(10_000) == 1


CHATTY = textwrap.dedent("""
    import os, sys, time
    # rank 1 prints its whole line while rank 0 is in the middle of its own (files order the two, bounded waits)
    def wait_for(name):
        deadline = time.monotonic() + 60
        while not os.path.exists(name) and time.monotonic() < deadline:
            time.sleep(0.01)

    if os.environ["RANK"] == "0":
        print("worker", end="", flush=True)
        print("half an error line", end="", file=sys.stderr, flush=True)
        time.sleep(0.3)
        open("mid-line", "w").close()
        wait_for("rank1-done")
        print("", 0, "done")
        print(" from rank 0", file=sys.stderr)
        print("unfinished", end="")  # ended by the shim when the worker ends
    else:
        wait_for("mid-line")
        print("worker", 1, "done", flush=True)
        time.sleep(0.3)
        open("rank1-done", "w").close()
""")


@pytest.mark.parametrize("prefix", [False, True], ids=["whole-lines", "rank-prefix"])
def test_worker_output_arrives_as_whole_lines(tmp_path, prefix):
    (tmp_path / "chatty.py").write_text(CHATTY)
    res = _run(tmp_path, "-n", "2", *(["--rank-prefix"] if prefix else []), "chatty.py")
    assert res.returncode == 0, res.stderr
    p0, p1 = ("[rank 0] ", "[rank 1] ") if prefix else ("", "")
    assert res.stdout == f"{p1}worker 1 done\n{p0}worker 0 done\n{p0}unfinished\n"
    assert res.stderr == f"{p0}half an error line from rank 0\n"


def test_restart_notice_reads_the_agents_own_records(capsys):
    import importlib
    import logging

    # the two records torch's agent writes when it restarts its workers, as its source writes them
    poll = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    again = "[%s] Worker group %s. %s/%s attempts left; will restart worker group"
    assert poll in inspect.getsource(importlib.import_module(launcher._POLL_LOGGER))
    agent_source = inspect.getsource(importlib.import_module(launcher._AGENT_LOGGER))
    assert '"%s/%s attempts left;"' in agent_source and '" will restart worker group"' in agent_source
    # and the two it writes when it stops a worker, SIGTERM then SIGKILL: the launcher's own, never a failure
    stop = "Sending process %s closing signal %s"
    force = "Unable to shutdown process %s via %s, forcefully exiting via %s"
    assert stop in inspect.getsource(importlib.import_module(launcher._POLL_LOGGER))
    assert force in inspect.getsource(importlib.import_module(launcher._POLL_LOGGER))
    notice = launcher._AgentRecords()
    notice.handle(logging.LogRecord(launcher._POLL_LOGGER, logging.WARNING, __file__, 0, stop, (4141, "SIGTERM"), None))
    notice.handle(logging.LogRecord(launcher._POLL_LOGGER, logging.WARNING, __file__, 0, force,
                                    (4040, "SIGTERM", "SIGKILL"), None))
    assert sorted(notice.stopped) == [4040, 4141]

    def record(name, level, msg, args):
        notice.handle(logging.LogRecord(name, level, __file__, 0, msg, args, None))

    record(launcher._POLL_LOGGER, logging.ERROR, poll, (-int(signal.SIGKILL), 1, 4242, "python"))
    record(launcher._AGENT_LOGGER, logging.INFO, again, ("default", "FAILED", 2, 2))
    record(launcher._POLL_LOGGER, logging.ERROR, poll, (1, 0, 4343, "python"))
    record(launcher._AGENT_LOGGER, logging.INFO, again, ("default", "FAILED", 1, 2))
    assert capsys.readouterr().err.splitlines() == [
        "fanfold run: local rank 1 (pid 4242) was killed by signal SIGKILL; restarting (attempt 1 of 2)",
        "fanfold run: local rank 0 (pid 4343) failed with exit code 1; restarting (attempt 2 of 2)",
    ]


def test_whole_lines_stream_passes_on_whole_lines_only():
    import io

    from fanfold.launcher.worker_shim import WholeLines

    class Target(io.StringIO):
        writes: list[str] = []

        def write(self, text):
            self.writes.append(text)
            return super().write(text)

    target = Target()
    out = WholeLines(target, "[rank 3] ")
    out.write("work")
    out.flush()  # an unfinished line is kept back, even on flush
    assert target.writes == []
    out.write("er 3 done\nnext")
    out.write(" 10%\r 20%\r")  # a progress bar redraws its line: each \r ends one
    out.write("a\r\nb")
    out.close_line()
    assert target.writes == ["[rank 3] worker 3 done\n", "[rank 3] next 10%\r[rank 3]  20%\r", "[rank 3] a\r\n",
                             "[rank 3] b\n"]
    assert out.getvalue() == target.getvalue()  # everything else is the target's
