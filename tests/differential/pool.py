"""A pool of W rank processes, started once and reused for every configuration of world size W.

Starting a rank (a new interpreter importing torch and fanfold) costs seconds on a busy machine; a configuration
costs a fraction of one. The pool hosts the TCP store its ranks rendezvous on (one port, chosen by the OS), sends
each configuration with a tag that names its store prefix, and waits for every rank's result, bounded: a rank that
dies is a *crash* (its exit code kept), a configuration that passes its time limit a *hang*. Either way the pool is
torn down (its processes killed by their ids, the shared-memory segments they left removed) and started afresh for
the next configuration.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import itertools
import multiprocessing as mp
import os
import pickle
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch.distributed as dist

from . import ranks

START_TIMEOUT = 180.0  # importing torch and fanfold W times on two shared cores
GRACE = 8.0  # seconds a rank may still be in a run after a peer's run raised: a run takes well under one


@dataclasses.dataclass
class Failure:
    kind: str  # "crash" or "hang"
    detail: str
    results: list = dataclasses.field(default_factory=list)  # what each rank had sent (RankResult)


class RankPool:
    def __init__(self, world: int):
        self.world = world
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=ranks.PG_TIMEOUT))
        self._tags = itertools.count()
        self._procs: list = []
        self._conns: list = []
        self._spare: tuple | None = None  # (processes, pipes) started ahead, importing while the pool works
        self.restarts = 0

    def _spawn(self) -> tuple[list, list]:
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=ranks.serve, args=(rank, self.world, self._store.port, child),
                               name=f"differential-rank{rank}", daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        return procs, conns

    def _start(self) -> None:
        """The spare ranks if there are (else new ones), ready; then the next spare, so that a restart after a
        crash, a hang or a stuck run waits for no imports."""
        (self._procs, self._conns), self._spare = self._spare or self._spawn(), None
        deadline = time.monotonic() + START_TIMEOUT
        for conn, proc in zip(self._conns, self._procs):
            if not _ready(conn, proc, deadline):
                self.close()
                raise RuntimeError(f"rank process {proc.name} did not start in {START_TIMEOUT:.0f} s "
                                   f"(exit code {proc.exitcode})")
        self._spare = self._spawn()

    def run(self, config, timeout: float, grace: float = GRACE) -> list | Failure:
        """Every rank's ``RankResult`` for ``config``, in rank order, or the Failure that ended it (with what the
        ranks had sent by then). Ranks still in a run ``grace`` seconds after a peer's run raised are stuck in a
        collective the peer never joins: their run ends there, with a timeout error and the steps they finished, as
        the group's timeout would end it, and the pool restarts for the implementations left. Cut short here (a
        test's time limit, Ctrl-C), the pool restarts too: its ranks are still in ``config`` and would send its
        results to whoever reads their pipes next."""
        results = [ranks.RankResult(r) for r in range(self.world)]
        deadline = time.monotonic() + timeout
        impls = ranks.impls_of(config)
        try:
            while impls:
                outcome = self._run(config, impls, results, deadline, grace)
                if not isinstance(outcome, str):
                    return outcome if isinstance(outcome, Failure) else results
                impls = impls[impls.index(outcome) + 1:]
        except BaseException:
            self._restart()
            raise
        return results

    def _run(self, config, impls: tuple, results: list, deadline: float, grace: float) -> str | Failure | None:
        """Run ``impls`` of ``config`` into ``results``: None when every rank is done, the implementation some
        ranks were stuck in, or a Failure."""
        if not self._procs:
            self._start()
        tag = f"c{next(self._tags)}"
        for conn in self._conns:
            conn.send((tag, config, impls))
        steps = [{impl: ranks.Run() for impl in impls} for _ in range(self.world)]  # streamed as they finish
        raised: dict = {}  # implementation -> (monotonic time, rank) of the first of its runs that raised
        pending = dict(enumerate(self._conns))
        while pending:
            sentinels = {self._procs[r].sentinel: r for r in pending}
            # the implementations some rank still owes a run of, after a peer's raised
            owed = {impl: at for impl, at in raised.items() if any(impl not in results[r].runs for r in pending)}
            until = min([deadline] + [at[0] + grace for at in owed.values()])
            ready = wait(list(pending.values()) + list(sentinels), timeout=max(until - time.monotonic(), 0))
            if not ready:
                late = [impl for impl, at in owed.items() if at[0] + grace <= time.monotonic()]
                if late and time.monotonic() < deadline:
                    impl = late[0]
                    self._stuck(results, steps, [r for r in pending if impl not in results[r].runs], impl,
                                raised[impl][1], grace)
                    return impl
                if time.monotonic() < deadline:
                    continue
                waiting = sorted(pending)
                self._restart()
                return Failure("hang", f"ranks {waiting} gave no result within the configuration's time limit",
                               results)
            for r, conn in list(pending.items()):
                if conn not in ready and self._procs[r].sentinel not in ready:
                    continue
                try:
                    while conn.poll():
                        message = pickle.loads(conn.recv_bytes())
                        if message[0] == "started":
                            results[r].running = message[1]
                        elif message[0] == "step":
                            step, run = message[2], steps[r][message[1]]
                            run.grads.append(step.grads)
                            run.params.append(step.params)
                            run.buffers.append(step.buffers)
                        elif message[0] == "run":
                            results[r].runs[message[1]], results[r].running = message[2], None
                            if message[2].error is not None and message[1] not in raised:
                                raised[message[1]] = (time.monotonic(), r)
                        else:
                            results[r].seconds += message[1]
                            del pending[r]
                            break
                    else:
                        if not self._procs[r].is_alive():
                            raise EOFError
                except (EOFError, OSError):
                    self._procs[r].join(5)
                    code = self._procs[r].exitcode
                    self._restart()
                    return Failure("crash", f"rank {r} died (exit code {code})", results)
        return None

    def _stuck(self, results: list, steps: list, stuck: list, impl: str, who: int, grace: float) -> None:
        for r in stuck:
            run = steps[r][impl]
            run.error = ("TimeoutError", f"rank {r} still in {impl}'s run {grace:.0f} s after rank {who}'s raised "
                                         "(the group's timeout would end it)", len(run.params))
            results[r].runs[impl], results[r].running = run, None
        self._restart()

    def _restart(self) -> None:
        _stop(self._procs, self._conns, kill=True)  # stuck or dead: no goodbye to wait for
        self._procs, self._conns = [], []
        self.restarts += 1

    def close(self) -> None:
        _stop(self._procs, self._conns, kill=False)
        if self._spare is not None:
            _stop(*self._spare, kill=False)
        self._procs, self._conns, self._spare = [], [], None


def _stop(procs: list, conns: list, kill: bool) -> None:
    """End the rank processes ``procs`` (by their ids: asked to leave, or killed), and remove the shared-memory
    segments they left."""
    for conn in conns:
        if not kill:
            with contextlib.suppress(OSError):
                conn.send(None)
    for proc in procs:
        if kill:
            proc.kill()
        proc.join(5 if kill else 2)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        # a rank killed between creating and unlinking a segment leaves it behind (segment.py's names)
        for path in glob.glob(f"/dev/shm/fanfold-*-{proc.pid}-*"):
            with contextlib.suppress(OSError):
                os.unlink(path)
    for conn in conns:
        conn.close()


def _ready(conn, proc, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                return pickle.loads(conn.recv_bytes()) == "ready"
            except (EOFError, OSError):
                return False
        if not proc.is_alive():
            return False
    return False

