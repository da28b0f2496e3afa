"""The stall matrix: a rank that skips a backward, issues an extra all_reduce, misses a barrier or a save, or is
killed, under fanfold's DDP over shared memory and over torch.distributed, torch's DDP on the ``fanfold`` backend,
and fanfold's ZeRO. Every rank is a real process ending by a normal exit (``_stall_program.py``); with
``FANFOLD_STALL_TIMEOUT=3`` and a group timeout of 60 s, the test asserts the diagnosis (the rank and the
collective named) and that every rank has raised within the stall timeout + 10 s of the moment the last rank
entered the collective it stalls in (a killed one is gone by then), then exits with no fanfold frame on any thread's
stack (its interpreter's own finalization, which load stretches, has a 60 s backstop): no wait lasts until the
group's timeout."""
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import fanfold
from fanfold.launcher.spawn import LOOPBACK, loopback_env

STALL = 3.0  # seconds; with 4 CPU-bound processes beside it (make test-busy) 2 s ended earlier collectives
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stall_program.py")
FANFOLD_SRC = os.path.dirname(fanfold.__file__)  # a frame of fanfold's names a file under it
EXIT_S = 60.0  # a backstop for the interpreter's exit after its report (no fanfold frame in it: asserted)
DEADLINE = 120.0  # the whole case, start-up included: far below the group's timeout (60 s) plus start-up


def _run(setup, case, nprocs, folder):
    """Start the ranks, wait for every process to end; per rank: its ENTERED times, RESULT, exit code and the
    time.time() at which it was seen gone."""
    # a plain TCPStore, as an agent's (TORCHELASTIC_USE_AGENT_STORE): the subject here is stalls, not the job store
    store = dist.TCPStore(LOOPBACK, 0, nprocs, True, timedelta(seconds=DEADLINE), wait_for_workers=False)
    port = store.port
    base = {**os.environ, "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0", "OMP_NUM_THREADS": "1",
            "FANFOLD_STALL_TIMEOUT": str(STALL), **loopback_env()}
    procs, outs = [], []
    try:
        for rank in range(nprocs):
            out = open(os.path.join(folder, f"rank{rank}.log"), "w+")
            outs.append(out)
            procs.append(subprocess.Popen([sys.executable, PROGRAM, setup, case, folder], stdout=out,
                                          stderr=subprocess.STDOUT,
                                          env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        gone = [None] * nprocs
        end = time.monotonic() + DEADLINE
        while None in gone and time.monotonic() < end:
            for r, p in enumerate(procs):
                if gone[r] is None and p.poll() is not None:
                    gone[r] = time.time()
            time.sleep(0.05)
        assert None not in gone, f"ranks {[r for r, g in enumerate(gone) if g is None]} still running"
        ranks = []
        for r, out in enumerate(outs):
            out.seek(0)
            text = out.read()
            entered = [float(line.split()[1]) for line in text.splitlines() if line.startswith("ENTERED ")]
            result = [json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")]
            reported = [float(line.split()[1]) for line in text.splitlines() if line.startswith("REPORTED ")]
            ranks.append({"entered": entered, "result": result[0] if result else None, "code": procs[r].returncode,
                          "gone": gone[r], "reported": reported[0] if reported else None, "log": text[-3000:]})
        return ranks
    finally:
        _reap(procs, outs)
        del store


def _reap(procs, outs):
    """Kill whatever rank is still running, wait for each, close their logs."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
    for out in outs:
        out.close()


CASES = [  # setup, case, ranks
    ("ddp-shm", "skip_backward", 2),
    ("ddp-shm", "killed", 3),
    ("ddp-torch", "missing_barrier", 2),
    ("ddp-torch", "skip_to_dist_barrier", 2),
    ("backend", "extra_all_reduce", 2),
    ("zero", "missing_save", 2),
]


@pytest.mark.parametrize("setup, case, nprocs", CASES, ids=[f"{s}-{c}" for s, c, _ in CASES])
def test_every_rank_diagnoses_and_exits_within_the_stall_timeout(setup, case, nprocs, tmp_path):
    ranks = _run(setup, case, nprocs, str(tmp_path))
    logs = "\n".join(f"--- rank {r}:\n{x['log']}" for r, x in enumerate(ranks))
    last_entry = max(x["entered"][-1] for x in ranks if x["entered"])
    for r, x in enumerate(ranks):
        # the seconds to the diagnosis and to the process's end, both from the last rank's entry
        took = {k: None if x[k] is None else round(x[k] - last_entry, 2) for k in ("reported", "gone")}
        if x["reported"] is None:  # killed (the culprit of "killed"): gone at once
            assert x["gone"] - last_entry < STALL + 10, (r, took, logs)
        else:
            # fanfold's part: every rank has diagnosed and raised within the stall timeout + 10 s ...
            assert x["reported"] - last_entry < STALL + 10, (r, took, logs)
            # ... and then exits waiting on nothing of fanfold's: an exit that lasts over EXIT_WARN_S prints every
            # thread's stack, which must hold no fanfold frame (what is left is the interpreter's own
            # finalization, about a second of CPU, which 4 CPU hogs stretched past 17 s in make test-busy)
            dump = x["log"].partition("Timeout (0:00:0")[2]
            assert FANFOLD_SRC not in dump, (r, took, logs)
            assert x["gone"] - x["reported"] < EXIT_S, (r, took, logs)
        assert x["code"] != 0, (r, logs)  # every rank fails: none finishes as if nothing happened
    victims = [x["result"] for r, x in enumerate(ranks) if r != 1]
    culprit = ranks[1]
    if case == "killed":
        assert culprit["code"] == -signal.SIGKILL, logs
        for v in victims:  # the survivors name the dead rank alone, not each other
            assert v["type"] == "StallError" and v["missing"] == [1], logs
            assert "Ranks that never arrived: [1]." in v["message"] and "is gone" in v["message"], logs
            assert "all_reduce #" in v["message"], logs
        return
    (victim,) = victims
    c = culprit["result"]
    # The culprit waits in the collective it went on to, bounded too: it gives up on its own (naming it) or is
    # ended by the victim's alarm, whichever comes first (here they entered within milliseconds of each other).
    culprit_in = {"skip_backward": "fanfold.save's all_gather #1", "missing_barrier": "fanfold.save's all_gather #1",
                  "missing_save": "DistributedDataParallel's barrier #"}
    if case in culprit_in:
        assert c["type"] == "StallError" and c["missing"] == [0], logs
        assert c["message"].startswith(f"rank 1 of 2: {culprit_in[case]}"), logs
        assert (f"did not complete within {STALL:g} s" in c["message"]
                or "rank 0 had diagnosed a stall" in c["message"]), logs
    if case == "skip_backward":
        # rank 0 waits in its last backward's all_reduce; rank 1 skipped it and waits in fanfold.save
        assert victim["type"] == "StallError" and victim["missing"] == [1], logs
        assert victim["message"].startswith("rank 0 of 2: DistributedDataParallel's all_reduce #6 (bucket 0) "), logs
        assert f"did not complete within {STALL:g} s. Ranks that never arrived: [1]." in victim["message"], logs
        assert "rank 1: behind: its last collective is all_reduce #5 (bucket 0)" in victim["message"], logs
    elif case == "skip_to_dist_barrier":
        # rank 1 waits in torch's own dist.barrier(): gloo ends rank 0's all_reduce at the stall timeout and closes
        # its connections, so that barrier fails at once instead of at the group's timeout (60 s)
        assert victim["type"] == "StallError" and victim["missing"] == [1], logs
        assert victim["message"].startswith("rank 0 of 2: DistributedDataParallel's all_reduce #6 (bucket 0) "), logs
        assert "Ranks that never arrived: [1]." in victim["message"], logs
        assert c["type"] in ("RuntimeError", "DistBackendError"), logs
    elif case == "missing_barrier":
        assert victim["type"] == "StallError" and victim["missing"] == [1], logs
        assert victim["message"].startswith("rank 0 of 2: DistributedDataParallel's barrier #7 "), logs
        assert "Ranks that never arrived: [1]." in victim["message"], logs
    elif case == "extra_all_reduce":
        # both meet in the shared memory under one number: each names the other's collective and the difference
        assert "rank 1 is in all_reduce of 1 float32" in victim["message"], logs
        assert "rank 0 is in all_reduce of " in c["message"], logs
    elif case == "missing_save":
        assert victim["type"] == "StallError" and victim["feature"] == "fanfold.save", logs
        assert victim["missing"] == [1], logs
        assert victim["message"].startswith("rank 0 of 2: fanfold.save's all_gather #1"), logs
        assert "Ranks that never arrived: [1]." in victim["message"], logs


_STORE_SERVER = ("import datetime, sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, 2, True, "
                 "datetime.timedelta(seconds=120), wait_for_workers=False); print(s.port, flush=True); time.sleep(600)")


def test_a_frozen_store_does_not_delay_the_exit(tmp_path):
    """The store's serving process stopped (SIGSTOP), then rank 1 killed: rank 0 diagnoses the death without the
    store (its diagnosis does not wait on a store that did not answer more than once) and its process is gone
    within the stall timeout + 10 s of the kill: its exit waits on no store call in flight."""
    folder = str(tmp_path)
    server = subprocess.Popen([sys.executable, "-c", _STORE_SERVER], stdout=subprocess.PIPE, text=True)
    procs, outs = [], []
    try:
        port = int(server.stdout.readline())
        base = {**os.environ, "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "OMP_NUM_THREADS": "1",
                "FANFOLD_STALL_TIMEOUT": str(STALL), **loopback_env()}
        for rank in range(2):
            outs.append(open(os.path.join(folder, f"rank{rank}.log"), "w+"))
            procs.append(subprocess.Popen([sys.executable, PROGRAM, "ddp-shm", "store_frozen_killed", folder],
                                          stdout=outs[rank], stderr=subprocess.STDOUT,
                                          env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        end = time.monotonic() + DEADLINE
        log1 = os.path.join(folder, "rank1.log")
        while "freeze the store" not in open(log1).read():
            assert time.monotonic() < end and procs[1].poll() is None, open(log1).read()[-3000:]
            time.sleep(0.02)
        os.kill(server.pid, signal.SIGSTOP)
        open(os.path.join(folder, "frozen"), "w").close()  # rank 1 kills itself now
        frozen = time.monotonic()
        while procs[0].poll() is None and time.monotonic() - frozen < STALL + 30:
            time.sleep(0.05)
        took = time.monotonic() - frozen
        outs[0].seek(0)
        log0 = outs[0].read()
        result = [json.loads(line[7:]) for line in log0.splitlines() if line.startswith("RESULT ")]
        assert took < STALL + 10, (took, log0[-3000:])
        assert procs[1].wait(10) == -signal.SIGKILL
        assert result and result[0]["type"] == "StallError", log0[-3000:]
        # the store did not answer: the dead rank is named from what the transport saw
        assert result[0]["missing"] == [1], log0[-3000:]
    finally:
        _reap(procs, outs)
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait(10)
