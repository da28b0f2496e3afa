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
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch.distributed as dist

from . import ranks

START_TIMEOUT = 180.0  # importing torch and fanfold W times on two shared cores


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
        self.restarts = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=ranks.serve, args=(rank, self.world, self._store.port, child),
                               name=f"differential-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        deadline = time.monotonic() + START_TIMEOUT
        for conn, proc in zip(self._conns, self._procs):
            if not _ready(conn, proc, deadline):
                self.close()
                raise RuntimeError(f"rank process {proc.name} did not start in {START_TIMEOUT:.0f} s "
                                   f"(exit code {proc.exitcode})")

    def run(self, config, timeout: float) -> list | Failure:
        """Every rank's ``RankResult`` for ``config``, in rank order, or the Failure that ended it (with what the
        ranks had sent by then)."""
        if not self._procs:
            self._start()
        tag = f"c{next(self._tags)}"
        for conn in self._conns:
            conn.send((tag, config))
        results = [ranks.RankResult(r) for r in range(self.world)]
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        while pending:
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = wait(list(pending.values()) + list(sentinels), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                waiting = sorted(pending)
                self._restart()
                return Failure("hang", f"ranks {waiting} gave no result in {timeout:.0f} s", results)
            for r, conn in list(pending.items()):
                if conn not in ready and self._procs[r].sentinel not in ready:
                    continue
                try:
                    while conn.poll():
                        message = conn.recv()
                        if message[0] == "started":
                            results[r].running = message[1]
                        elif message[0] == "run":
                            results[r].runs[message[1]], results[r].running = message[2], None
                        else:
                            results[r].seconds = message[1]
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
        return results

    def _restart(self) -> None:
        self.close()
        self.restarts += 1

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            # a rank killed between creating and unlinking a segment leaves it behind (segment.py's names)
            for path in glob.glob(f"/dev/shm/fanfold-*-{proc.pid}-*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


def _ready(conn, proc, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                return conn.recv() == "ready"
            except (EOFError, OSError):
                return False
        if not proc.is_alive():
            return False
    return False

