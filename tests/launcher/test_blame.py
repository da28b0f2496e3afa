"""`fanfold run` blames the root cause: the rank that died (a signal, or a failure of its own) before any other rank
failed, whatever order the agent sees the deaths in; ranks that failed because that peer was gone are consequences;
ranks the agent stopped are never a failure. The oracle is the test's own knowledge of which rank it killed (or made
fail) and python's exit code for that death (128 + 9 for SIGKILL, 1 for an uncaught exception).

Each case runs FANFOLD_BLAME_REPEATS times (default 2): the order is a race that load decides, so the busy check runs
many more with CPU hogs beside it (docs/launching.md, "Failures"). Also here: ``--stall-timeout``.
"""
from __future__ import annotations

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

from fanfold.cli import run as run_cli
from fanfold.launcher import agent as launcher
from fanfold.launcher.blame import blame

REPEATS = int(os.environ.get("FANFOLD_BLAME_REPEATS", "2"))
TIMEOUT = 240  # one launch; the CPU is shared with other test runs: generous, never relied on
VICTIM = 1  # the rank that dies: not rank 0, which a tie broken by rank number would name

# Every rank writes its pid; the victim dies in the way `case` says, the others are in a collective by then.
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    case, victim = sys.argv[1], int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(f"pid{rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(f"pid{rank}.tmp", f"pid{rank}")

    def others_inside():  # the other ranks are about to enter the collective the victim will never join
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"in{r}") for r in range(world) if r != victim):
            assert time.monotonic() < deadline, "the other ranks never reached the collective"
            time.sleep(0.01)
        time.sleep(0.3)

    if case == "self_kill":  # mid-epoch of fanfold's DDP, as a script that an OOM killer stops
        import fanfold.distributed as fd
        fd.init_process_group()
        torch.manual_seed(0)
        model = fd.DistributedDataParallel(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(200):
            if step == 5 and rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    elif case == "external_kill":  # gloo all-reduces until the test kills the victim from outside
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        for _ in range(3000):
            dist.all_reduce(torch.ones(4))
            time.sleep(0.05)
    else:  # the victim dies while the others wait in an all-reduce of the fanfold backend
        dist.init_process_group("fanfold", timeout=timedelta(seconds=60))
        dist.all_reduce(torch.ones(4))  # every rank up
        if rank != victim:
            open(f"in{rank}", "w").close()
            dist.all_reduce(torch.ones(4))
        else:
            others_inside()
            if case == "kill_in_collective":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"boom from rank {rank}")
    time.sleep(120)  # never reached by a healthy run of these cases: the victim is gone
""")

CASES = {"self_kill": 128 + signal.SIGKILL, "external_kill": 128 + signal.SIGKILL,
         "kill_in_collective": 128 + signal.SIGKILL, "exception": 1}


def _env() -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RANK", "WORLD_SIZE",
                "FANFOLD_STALL_TIMEOUT"):
        env.pop(var, None)
    return env


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _leftovers(pids: list[int], seconds: float = 30.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if not _gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _launch(work: Path, case: str, nproc: int) -> tuple[subprocess.CompletedProcess, list[int]]:
    """One `fanfold run` of the case in ``work``; returns it and the workers' pids."""
    work.mkdir()
    (work / "blame.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "fanfold", "run", "-n", str(nproc), "--stall-timeout", "60", "blame.py", case,
           str(VICTIM)]
    proc = subprocess.Popen(cmd, cwd=work, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if case == "external_kill":
            deadline = time.monotonic() + TIMEOUT
            # every rank started (the report needs them all), then the victim dies
            while not all((work / f"pid{r}").exists() for r in range(nproc)):
                assert proc.poll() is None and time.monotonic() < deadline, "the workers never started"
                time.sleep(0.05)
            time.sleep(1.0)  # into the all-reduce loop (or still joining the group: a death either way)
            os.kill(int((work / f"pid{VICTIM}").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    pids = [int((work / f"pid{r}").read_text()) for r in range(nproc) if (work / f"pid{r}").exists()]
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), pids


def _verdict(res: subprocess.CompletedProcess, pids: list[int], nproc: int, code: int) -> str:
    """'' when the report blames the victim alone and exits with its code, else what went wrong."""
    lines = res.stderr.splitlines()
    heads = [ln for ln in lines if re.match(r"fanfold run: rank \d+ \(local rank", ln)]
    how = "was killed by signal SIGKILL" if code == 128 + signal.SIGKILL else f"failed with exit code {code}"
    expected = f"fanfold run: rank {VICTIM} (local rank {VICTIM}, pid {pids[VICTIM]}) {how}"
    if heads != [expected] or res.returncode != code or lines[-1:] != [f"fanfold run: exit code {code}"]:
        return f"exit {res.returncode}, report: {heads or lines[-5:]}"
    # every other rank is a consequence of the victim's death or was stopped: none failed "after" it on its own
    if any("also failed" in ln for ln in lines):  # with the report's end: which exception it was
        return (f"another rank's failure not seen as a consequence: {[ln for ln in lines if 'also failed' in ln]}\n"
                + "\n".join(ln for ln in lines[-40:] if not ln.startswith(("I1", "W1"))))
    if "killed by signal SIGTERM" in res.stderr:
        return "the agent's own SIGTERM reported as a failure"
    return ""


@pytest.mark.timeout(300 + REPEATS * TIMEOUT)
@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_report_blames_the_rank_that_died_first(tmp_path, case, nproc):
    wrong, pids = [], []
    for i in range(REPEATS):
        res, run_pids = _launch(tmp_path / f"run{i}", case, nproc)
        pids += run_pids
        assert len(run_pids) == nproc, f"run {i}: not every worker started:\n{res.stderr[-3000:]}"
        why = _verdict(res, run_pids, nproc, CASES[case])
        print(f"blame {case} -n {nproc} run {i}: {why or 'right'}", flush=True)  # for a long run's count (-s)
        if why:
            wrong.append(f"run {i}: {why}\n{res.stderr[-3000:]}")
    print(f"blame {case} -n {nproc}: {REPEATS - len(wrong)} of {REPEATS} right")
    assert _leftovers(pids) == [], "workers left running"
    assert not wrong, f"{len(wrong)} of {REPEATS} runs blamed the wrong rank:\n" + "\n".join(wrong)


# The report itself, on the agent's failures as they arrive on a loaded machine (the order a race decides above).

def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None = None, time_ns: int = 0,
             gone: list[int] | None = None) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    if message is not None:
        info = {"py_callstack": f"Traceback (most recent call last):\n{message}\n", "timestamp": str(time_ns // 10**9),
                "time_ns": time_ns}
        if gone is not None:
            info["peer_gone"] = gone
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))
    if message is None:
        failure.timestamp = 1_700_000_005  # the agent saw the death in this second
    return failure


def test_consequence_seen_before_the_death_is_not_its_cause(tmp_path):
    # Rank 0's StallError (rank 1 gone) has an earlier clock than the second the agent saw rank 1's SIGKILL in.
    err = ChildFailedError("x", {
        0: _failure(tmp_path, 0, 1, "StallError: rank 0 of 2: ... its process 1001 is gone", 1_700_000_004 * 10**9,
                    gone=[1]),
        1: _failure(tmp_path, 1, -int(signal.SIGKILL)),
    })
    found = blame(err, stopped={})
    assert (found.root, found.exit_code, found.consequences) == (1, 137, {0: [1]})
    text = launcher.format_failure(err, found=found)
    assert text.splitlines() == [
        "fanfold run: rank 1 (local rank 1, pid 1001) was killed by signal SIGKILL",
        "no Python traceback: the process was killed (any output it left is above)",
        "fanfold run: rank 0: its peer rank 1 is gone (StallError)",
        "fanfold run: exit code 137"]


def test_a_dead_rank_the_agent_also_signalled_is_still_the_cause(tmp_path):
    # Rank 0 saw rank 1's process gone and failed first; the agent, seeing that failure, signalled every other
    # worker, rank 1 among them (killed, not yet reaped): rank 1 died on its own all the same.
    err = ChildFailedError("x", {
        0: _failure(tmp_path, 0, 1, "ShmTimeoutError: ... (rank 1's process 1001 is gone)", 1_700_000_004 * 10**9,
                    gone=[1]),
        1: _failure(tmp_path, 1, -int(signal.SIGKILL)),
    })
    found = blame(err, stopped={1001: 1_700_000_006 * 10**9})
    assert (found.root, found.exit_code, found.consequences, found.stopped) == (1, 137, {0: [1]}, [])


def test_the_agents_own_sigterm_is_never_the_cause(tmp_path):
    # Both deaths seen in the same second; rank 0 by the SIGTERM the agent sent it after seeing rank 1's SIGKILL.
    err = ChildFailedError("x", {0: _failure(tmp_path, 0, -int(signal.SIGTERM)),
                                 1: _failure(tmp_path, 1, -int(signal.SIGKILL)),
                                 2: _failure(tmp_path, 2, -int(signal.SIGTERM))})
    found = blame(err, stopped={1000: 1, 1002: 1})
    assert (found.root, found.stopped, found.exit_code) == (1, [0, 2], 137)
    assert launcher.format_failure(err, found=found).splitlines()[-2:] == [
        "fanfold run: stopped the other workers (ranks [0, 2])", "fanfold run: exit code 137"]
    # a SIGTERM from anyone else is a death like any other: the first in rank order when seen in the same second
    outside = blame(err, stopped={1002: 1})
    assert (outside.root, outside.later, outside.stopped, outside.exit_code) == (0, [1], [2], 143)


def test_an_error_raised_after_the_agents_stop_is_the_stops(tmp_path):
    # a SIGTERM handler that raises: the exception comes after the agent's signal, so the rank was stopped
    err = ChildFailedError("x", {
        0: _failure(tmp_path, 0, 1, "KeyboardInterrupt: stop", time_ns=2_000),
        1: _failure(tmp_path, 1, 3, "ValueError: the real cause", time_ns=1_000),
    })
    assert blame(err, stopped={1000: 1_500}).root == 1
    assert blame(err, stopped={1000: 1_500}).stopped == [0]
    assert blame(err, stopped={1000: 2_500}).later == [0]  # raised before it was signalled: a failure of its own


PROBE = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from fanfold.collectives.timeouts import resolve_stall_timeout
    dist.init_process_group("fanfold", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    with open(f"seen{rank}", "w") as f:
        f.write(f"{os.environ.get('FANFOLD_STALL_TIMEOUT')} {resolve_stall_timeout()}")
    dist.all_reduce(torch.ones(2))
    if rank == 1:  # skips the next collective, alive
        time.sleep(150)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    finally:
        with open("waited", "w") as f:
            f.write(str(time.monotonic() - start))
""")


def test_stall_timeout_flag_reaches_the_workers_and_bounds_a_skipped_collective(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    res = subprocess.run([sys.executable, "-m", "fanfold", "run", "-n", "2", "--stall-timeout", "5", "probe.py"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert [(tmp_path / f"seen{r}").read_text() for r in range(2)] == ["5.0 5.0"] * 2
    waited = float((tmp_path / "waited").read_text())
    # the default would wait 300 s; the diagnosis adds at most a few bounded store round trips to the 5 s
    assert 4.5 <= waited < 60, waited
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stderr.startswith("fanfold run: rank 0 (local rank 0, pid "), res.stderr[-3000:]
    assert re.search(r"\b(StallError|ShmTimeoutError): ", res.stderr), res.stderr[-3000:]


@pytest.mark.parametrize("value, why", [("0", "must be positive"), ("-2", "must be positive"),
                                        ("soon", "must be a number of seconds"), ("nan", "must be positive")])
def test_stall_timeout_refuses_what_is_not_a_positive_number(tmp_path, capsys, value, why):
    with pytest.raises(ValueError, match=f"^stall_timeout {why}, got {value!r}$"):
        launcher.launch_script([str(tmp_path / "missing.py")], stall_timeout=value)
    parser = ArgumentParser(prog="fanfold run")
    run_cli.add_arguments(parser)
    with pytest.raises(SystemExit) as exit_:
        run_cli.main(parser.parse_args(["--stall-timeout", value, "missing.py"]))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"fanfold run: error: --stall-timeout {why}, got {value!r}"


def test_worker_shim_tells_a_dead_peers_consequence_from_a_failure_of_its_own():
    from fanfold.collectives.protocol import StallError
    from fanfold.launcher.worker_shim import peers_gone

    stall = StallError("rank 0 of 3: all_reduce #4 did not complete", rank=0, seq=4, kind="all_reduce", bucket=None,
                       missing=[1, 2], gone=[2])
    assert peers_gone(stall) == [2]
    # across torch's C++ only the message survives: fanfold's words for a dead process, gloo's for a closed socket
    assert peers_gone(RuntimeError("... waited in all_reduce for rank 1, which never arrived (rank 1's process 77 "
                                   "is gone)")) == [1]
    assert peers_gone(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4242")) == []
    # gloo's other texts for a peer's socket gone: lower case from its error codes, a pair closed by an earlier op
    assert peers_gone(RuntimeError("[pair.cc:598] connection reset by peer [127.0.0.1]:4242")) == []
    assert peers_gone(RuntimeError("[pair.cc:420] Socket closed [127.0.0.1]:4242")) == []
    assert peers_gone(RuntimeError("[tcp/pair.cc:137] connect [127.0.0.1]:4242: Connection refused")) == []
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as exc:
            raise ValueError("the user's wrapper") from exc
    except ValueError as wrapped:
        assert peers_gone(wrapped) == []
    assert peers_gone(ValueError("boom from rank 1")) is None
    assert peers_gone(StallError("rank 0 of 2: all_reduce #4 did not complete within 5 s", rank=0, seq=4,
                                 kind="all_reduce", bucket=None, missing=[1])) is None  # alive and behind: a stall


def test_an_agent_error_is_not_reported_as_a_bad_flag(tmp_path, monkeypatch, capsys):
    # The CLI turns launch_script's ValueError into a usage error naming a flag; one raised inside torch's agent
    # (e.g. json.load of a worker's error file) is a failure of the run, shown with its traceback.
    import json

    import torch.distributed.launcher.api as torch_launcher

    def broken(config, entrypoint):
        def run(*args):
            raise json.JSONDecodeError("Expecting value", "", 0)
        return run

    monkeypatch.setattr(torch_launcher, "elastic_launch", broken)
    (tmp_path / "ok.py").write_text("pass\n")
    with pytest.raises(RuntimeError, match="torch's elastic agent failed while it ran the workers.*Expecting value"):
        launcher.launch_script([str(tmp_path / "ok.py")], nproc_per_node=1)
    parser = ArgumentParser(prog="fanfold run")
    run_cli.add_arguments(parser)
    with pytest.raises(RuntimeError):
        run_cli.main(parser.parse_args(["-n", "1", str(tmp_path / "ok.py")]))
    assert "usage:" not in capsys.readouterr().err
