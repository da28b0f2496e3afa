"""Rank processes forked from a server for torch's distributed test harness: the part the two conformance drivers
(``driver.py``: torch's DDP tests; ``collectives.py``: its collective tests on the ``fanfold`` backend) share.

torch's harness (``TestDistBackend``) spawns each rank: a new interpreter importing torch and the suite, seconds per
rank and test. With ``START_ENV=forkserver`` the ranks are forked from one server that imported the modules in
``preload`` once; a forked rank then takes the environment the parent had when it started the test from
``<file_name>.env``, as a spawned one would inherit it (the harness sets ``TEMP_DIR`` and ``INIT_METHOD`` anew for
each test), and runs ``in_rank()`` before the process group and the test. Layer: a tool beside the package.
"""
from __future__ import annotations

import json
import os

import torch

START_ENV = "FANFOLD_CONFORMANCE_START"

__all__ = ["ForkedRanks", "START_ENV"]


class ForkedRanks:
    """A mixin before ``TestDistBackend`` in a test case's bases."""

    preload: tuple[str, ...] = ()  # modules the fork server imports once
    file_name: str

    def setUp(self) -> None:
        super().setUp()
        with open(self.file_name + ".env", "w") as f:
            json.dump(dict(os.environ), f)
        self._spawn_processes()

    def tearDown(self) -> None:
        super().tearDown()
        if os.path.exists(self.file_name + ".env"):
            os.unlink(self.file_name + ".env")

    def _spawn_processes(self) -> None:
        if os.environ.get(START_ENV, "spawn") == "spawn":
            return super()._spawn_processes()
        context = torch.multiprocessing.get_context("forkserver")
        # naming "__main__" in the preload would be ignored: Python 3.11's forkserver never receives the main
        # module's path; each rank re-runs only the driver module's top level
        context.set_forkserver_preload(list(self.preload))
        self._start_processes(context.Process)

    @classmethod
    def in_rank(cls) -> None:
        """What the rank process does first (the driver's choice of DDP or backend)."""

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe, **kwargs) -> None:
        with open(file_name + ".env") as f:
            environ = json.load(f)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(1)  # a few small tensors per test: no thread pool per rank on a shared machine
        cls.in_rank()
        super()._run(rank, test_name, file_name, pipe, **kwargs)
