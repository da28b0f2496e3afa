"""Run tests of torch's ``DistributedTest._DistTestBase`` on CPU, gloo, 2 ranks, with torch's DDP or fanfold's.

    python conformance/driver.py --ddp fanfold --results out.jsonl test_ddp_logging_data_cpu ...

The same set-up as torch's own driver (``test/distributed/test_distributed_spawn.py``, not shipped in the wheel):
``BACKEND=gloo``, ``WORLD_SIZE=2``, one test case class combining ``TestDistBackend`` (process spawning, the
file-based rendezvous, the barrier directory) with ``_DistTestBase`` (the tests). Each test spawns fresh rank
processes; ``--ddp fanfold`` makes every rank process, before the test runs, rebind ``DistributedDataParallel`` in
``torch.nn.parallel``, ``torch.nn.parallel.distributed`` and the test module (which imported the name at import
time) to ``fanfold.DistributedDataParallel``. ``SelfCheck.test_ddp_names_in_rank`` checks that from inside a rank.
``--cuda-on-cpu`` also maps the suite's CUDA devices to the CPU in every rank (``cuda_on_cpu.install``) and skips
the tests of CUDA itself (``reasons.CUDA_ONLY``) with their reason.

Each finished test appends one JSON line to ``--results`` (written as it goes, so a killed run keeps what it had):
``{"test", "status": pass|fail|timeout|skip, "seconds", "detail"}``, preceded by ``{"test", "event": "start"}``.
A test is bounded by ``--timeout`` seconds (torch's harness then terminates its rank processes).

Layer: a tool beside the package; driven by ``run.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import unittest

# distributed_test reads these at import time, in this process and in every spawned rank process (which re-imports
# this module): set them before importing it.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
DDP_ENV = "FANFOLD_CONFORMANCE_DDP"
CUDA_ON_CPU_ENV = "FANFOLD_CONFORMANCE_CUDA_ON_CPU"

import torch  # noqa: E402
import torch.nn.parallel.distributed as torch_ddp_module  # noqa: E402
from cuda_on_cpu import install  # noqa: E402
from forked_ranks import START_ENV, ForkedRanks  # noqa: E402
from reasons import CUDA_ONLY  # noqa: E402
from torch.testing._internal import common_distributed  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

TORCH_DDP = torch_ddp_module.DistributedDataParallel
# Every module that binds the name at import time and that the tests reach (found by scanning sys.modules after
# importing the suite; torch._dynamo and torch.distributed._composable also bind it but no DDP test goes there).
HOMES = ("torch.nn.parallel", "torch.nn.parallel.distributed", distributed_test.__name__)


def ddp_class(impl: str) -> type:
    """The DistributedDataParallel class named by ``impl`` ("torch" or "fanfold")."""
    if impl == "torch":
        return TORCH_DDP
    if impl == "fanfold":
        import fanfold

        return fanfold.DistributedDataParallel
    raise ValueError(f"{DDP_ENV} must be 'torch' or 'fanfold', got {impl!r}")


def use_ddp(impl: str) -> type:
    """Rebind ``DistributedDataParallel`` in every module of ``HOMES`` to ``impl``'s class; returns the class."""
    cls = ddp_class(impl)
    for name in HOMES:
        setattr(sys.modules[name], "DistributedDataParallel", cls)
    return cls


class TestDistBackendGloo(ForkedRanks, TestDistBackend, DistributedTest._DistTestBase):
    """torch's DDP tests in fresh rank processes per test, each with the chosen DDP (forked ranks: ``ForkedRanks``)."""

    preload = (distributed_test.__name__,)

    def setUp(self) -> None:
        if os.environ.get(CUDA_ON_CPU_ENV) and self._testMethodName in CUDA_ONLY:
            self.skipTest(f"CUDA itself: {CUDA_ONLY[self._testMethodName]}")
        super().setUp()

    def tearDown(self) -> None:
        super().tearDown()
        if os.path.exists(self.file_name):
            os.unlink(self.file_name)

    @classmethod
    def in_rank(cls) -> None:
        chosen = use_ddp(os.environ[DDP_ENV])
        if os.environ.get(CUDA_ON_CPU_ENV):
            install(chosen, int(os.environ["WORLD_SIZE"]))


class SelfCheck(TestDistBackendGloo):
    """The patching itself, checked from inside a rank process."""

    def test_ddp_names_in_rank(self) -> None:
        expected = ddp_class(os.environ[DDP_ENV])
        for name in HOMES:
            self.assertIs(getattr(sys.modules[name], "DistributedDataParallel"), expected, name)
        if expected is not TORCH_DDP:
            left = [f"{m}.{k}" for m, mod in list(sys.modules.items())
                    if m.startswith(("torch.nn", "torch.testing")) or m in ("__main__", "__mp_main__")
                    for k, v in list(getattr(mod, "__dict__", {}).items()) if v is TORCH_DDP and k != "TORCH_DDP"]
            self.assertEqual(left, [], f"names still bound to torch's DistributedDataParallel: {left}")
        # one step through the name the tests use: the class is the chosen one and it averages the gradients
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        oracle = torch.nn.Linear(3, 1)
        oracle.load_state_dict(model.state_dict())
        ddp = distributed_test.DistributedDataParallel(model)
        self.assertIsInstance(ddp, expected)
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        ddp(x[2 * self.rank: 2 * self.rank + 2]).pow(2).sum().backward()
        (oracle(x).pow(2).sum() / 2).backward()
        torch.testing.assert_close(model.weight.grad, oracle.weight.grad)


def _name(test: unittest.TestCase) -> str:
    """The name the test was asked for: the method name, prefixed with ``SelfCheck.`` for the self-check."""
    method = test._testMethodName
    return f"SelfCheck.{method}" if isinstance(test, SelfCheck) else method


class _JsonResult(unittest.TestResult):
    """Appends each test's outcome to a JSON-lines file as soon as it is known."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.started = 0.0

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self.started = time.monotonic()
        self._write({"test": _name(test), "event": "start"})

    def _outcome(self, test: unittest.TestCase, status: str, detail: str) -> None:
        if status == "fail" and "terminated or timed out after" in detail:
            status = "timeout"
        self._write({"test": _name(test), "status": status,
                     "seconds": round(time.monotonic() - self.started, 1), "detail": detail})

    def addSuccess(self, test):
        super().addSuccess(test)
        self._outcome(test, "pass", "")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._outcome(test, "fail", self.failures[-1][1])

    def addError(self, test, err):
        super().addError(test, err)
        self._outcome(test, "fail", self.errors[-1][1])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._outcome(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._outcome(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._outcome(test, "fail", "unexpected success")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ddp", choices=("torch", "fanfold"), required=True)
    parser.add_argument("--results", required=True, help="JSON-lines file to append to")
    parser.add_argument("--timeout", type=int, default=150, help="seconds per test (default 150)")
    parser.add_argument("--start-method", choices=("spawn", "forkserver"), default="spawn",
                        help="how rank processes start: spawn (torch's way) or forkserver (faster)")
    parser.add_argument("--cuda-on-cpu", action="store_true",
                        help="map the suite's CUDA devices to the CPU in every rank (cuda_on_cpu.py)")
    parser.add_argument("tests", nargs="+", help="test method names; SelfCheck.test_ddp_names_in_rank for the check")
    args = parser.parse_args(argv)
    os.environ[DDP_ENV] = args.ddp  # inherited by the rank processes
    os.environ[START_ENV] = args.start_method
    if args.cuda_on_cpu:
        os.environ[CUDA_ON_CPU_ENV] = "1"
    ddp_class(args.ddp)  # fail here, not in every rank, if fanfold does not import
    # torch's harness reads its timeouts at each test: one bound for all, overrides included
    common_distributed.TIMEOUT_DEFAULT = args.timeout
    common_distributed.TIMEOUT_OVERRIDE.clear()
    suite = unittest.TestSuite()
    for name in args.tests:
        cls, _, method = name.rpartition(".")
        suite.addTest((SelfCheck if cls == "SelfCheck" else TestDistBackendGloo)(method))
    result = _JsonResult(args.results)
    suite.run(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
