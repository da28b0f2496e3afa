"""torch's own collective tests (``DistributedTest._DistTestBase``, CPU) on gloo and on ``fanfold``, 2 and 3 ranks.

    python conformance/collectives.py --all              # `make conformance-backend`: both backends at 2, 3 and
                                                         # 8 ranks, then docs/conformance-backend.md
    python conformance/collectives.py --backend gloo     # build/conformance-backend/gloo-2.json
    python conformance/collectives.py --backend fanfold  # every rank's gloo groups become fanfold groups
    python conformance/collectives.py --backend fanfold --world-size 3 --only test_all_gather --keep
    python conformance/collectives.py --report           # docs/conformance-backend.md from every size run

The suite is set up as torch's own driver does (``BACKEND=gloo``, ``WORLD_SIZE`` from ``--world-size``, default 2;
``TestDistBackend`` starting fresh rank processes per test, forked from a forkserver by default), so the suite
takes the same decisions (skips, expectations) in both runs. With ``--backend fanfold`` each rank process, before
its test, rebinds ``torch.distributed``'s ``init_process_group`` and ``new_group`` so that a gloo group is created
as a ``fanfold`` one: the only difference between the two runs is the backend under the collectives. Tests are
those whose names name a collective, and gloo's point-to-point ones, without DDP and GPU ones
(``collective_tests``). Every collective the backend runs in shared memory is covered: all_reduce (and coalesced;
SUM, AVG, MIN, MAX, PRODUCT), broadcast, barrier and all_gather by the suite's tests; all_to_all_single (which the
suite runs on CPU with MPI only), all_gather_into_tensor and reduce_scatter_tensor (CUDA only there) by the suite's
own helpers called with CPU tensors (``cpu_collectives.py``). The page is ``backend_report.py``'s.
Layer: a tool beside the package (imports ``fanfold`` only to register the backend).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import unittest
from pathlib import Path

os.environ.setdefault("BACKEND", "gloo")
if __name__ == "__main__":  # torch's suite reads WORLD_SIZE: set before it is imported, inherited by the ranks
    _early = argparse.ArgumentParser(add_help=False)
    _early.add_argument("--world-size", type=int, default=2)
    os.environ["WORLD_SIZE"] = str(_early.parse_known_args()[0].world_size)
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "300")  # the harness's bound per test, torch's default
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")  # the error, not torch's hint, ends the traceback
SWAP_ENV = "FANFOLD_CONFORMANCE_BACKEND"
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "conformance-backend"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from backend_report import write_page  # noqa: E402
from cpu_collectives import CpuCollectives  # noqa: E402 - after WORLD_SIZE is set
from forked_ranks import START_ENV, ForkedRanks  # noqa: E402
from report import revision  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

import fanfold  # noqa: E402,F401 - registers the backend, in this process and in every rank process


def _swap(backend):
    return "fanfold" if backend in (None, "gloo", dist.Backend.GLOO) else backend


def use_fanfold() -> None:
    """Create every gloo group (the default one and new_group's) as a fanfold group instead (once per process)."""
    if getattr(dist.init_process_group, "fanfold_swap", False):
        return
    real_init, real_new = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, *args, **kwargs):
        real_init(_swap(backend), *args, **kwargs)
        if "fanfold" not in dist.get_backend():  # the self-check: this run must not measure gloo again
            raise RuntimeError(f"the conformance run got a {dist.get_backend()} group, not fanfold")

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        return real_new(ranks, timeout, _swap(backend), *args, **kwargs)
    init_process_group.fanfold_swap = True
    dist.init_process_group, dist.new_group = init_process_group, new_group


if os.environ.get(SWAP_ENV) == "fanfold":
    use_fanfold()

_PICK = re.compile(r"all_reduce|allreduce|broadcast|all_gather|allgather|reduce_scatter|barrier|all_to_all|_reduce_|"
                   r"^test_reduce|gather|scatter")
# point-to-point is no collective, but the backend must hand it to its inner gloo group intact
_P2P = re.compile(r"^test_(send_recv|send_recv_any_source|send_recv_with_tag|isend|irecv|batch_isend_irecv_gloo\w*)$")
_DROP = re.compile(r"ddp|DistributedDataParallel|cuda|nccl|gpu|profil|hook|unused_parameters", re.I)


def collective_tests() -> list[str]:
    """The suite's collective tests (and its gloo point-to-point ones) that can run on CPU, by name."""
    return sorted(n for n in dir(TestDistBackendCollectives)
                  if n.startswith("test_") and (_PICK.search(n) or _P2P.match(n)) and not _DROP.search(n))


class TestDistBackendCollectives(CpuCollectives, ForkedRanks, TestDistBackend, DistributedTest._DistTestBase):
    """The suite's tests in fresh rank processes per test (forked ranks: ``ForkedRanks``), on the chosen backend."""

    preload = (distributed_test.__name__, "fanfold")

    @classmethod
    def in_rank(cls) -> None:
        if os.environ.get(SWAP_ENV) == "fanfold":
            use_fanfold()


def run(backend: str, tests: list[str], path: Path, keep: bool = False, start: str = "forkserver") -> dict:
    """Run ``tests`` on ``backend``, rewriting ``path`` after each (a run cut short keeps what it had); with
    ``keep``, the results already in ``path`` for other tests stay (a rerun of a few). ``start``: how rank
    processes start, "spawn" (torch's way) or "forkserver" (faster)."""
    os.environ[SWAP_ENV] = backend  # the ranks read it when they start
    os.environ[START_ENV] = start
    results = json.loads(path.read_text()) if keep and path.exists() else {}
    t_run = time.monotonic()
    for name in tests:
        suite = unittest.TestSuite([TestDistBackendCollectives(name)])
        result = unittest.TestResult()
        t0 = time.monotonic()
        suite.run(result)
        status = ("fail" if result.failures or result.errors else "skip" if result.skipped else "pass")
        detail = "".join(tb for _, tb in result.failures + result.errors)[-2000:] or (
            result.skipped[0][1] if result.skipped else "")
        results[name] = {"status": status, "seconds": round(time.monotonic() - t0, 1), "detail": detail}
        print(f"{backend} {name}: {status}", flush=True)
        path.write_text(json.dumps(results, indent=1))
    if not keep:
        _record(backend, int(os.environ["WORLD_SIZE"]), time.monotonic() - t_run)
    return results


SELECTION = (
    "The suite is torch's `DistributedTest._DistTestBase` (`torch/testing/_internal/distributed/distributed_test.py` "
    "in the installed wheel), driven as torch's `test/distributed/test_distributed_spawn.py` drives it "
    "(`BACKEND=gloo`, `WORLD_SIZE` = the ranks, a fresh set of rank processes per test), plus `cpu_collectives.py`'s "
    "CPU versions of the suite's all_to_all_single, all_gather_into_tensor and reduce_scatter_tensor helpers (torch "
    "runs them on MPI or CUDA only). Selected by `collective_tests()`: every test whose name names a collective "
    "(all_reduce, broadcast, all_gather, reduce_scatter, barrier, all_to_all, reduce, gather, scatter; their "
    "`_group`, `_full_group`, `_coalesced`, `_complex`, object and monitored-barrier variants), and gloo's "
    "point-to-point tests (send/recv, isend/irecv, batch_isend_irecv: the backend hands them to its inner gloo "
    "group); without DDP, CUDA, NCCL, GPU, profiler and hook tests: {count} tests. The `_group` tests skip below "
    "8 ranks (torch's `skip_if_small_worldsize`): the 8-rank run is theirs; the rest of the skips are the "
    "suite's own decisions (MPI only, "
    "exact world size 4, CUDA, `file://` init only, known issues), the same for both backends.")


def _record(backend: str, size: int, seconds: float) -> None:
    runs_file = OUT / "runs.json"
    runs = json.loads(runs_file.read_text()) if runs_file.exists() else {}
    runs[f"{backend}-{size}"] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                 "seconds": round(seconds), "revision": revision(ROOT)}
    runs_file.write_text(json.dumps(runs, indent=1))


def report(page: Path) -> None:
    runs_file = OUT / "runs.json"
    runs = json.loads(runs_file.read_text()) if runs_file.exists() else {}
    meta = {"command": "`python conformance/collectives.py --all` (each backend and size: `--backend B "
                       "--world-size N`; then `--report`)",
            "runs": "; ".join(f"{k} on {v['date']} ({v['seconds'] // 60} min {v['seconds'] % 60} s, fanfold "
                              f"revision {v['revision']})" for k, v in sorted(runs.items())) or "unknown",
            "environment": f"torch {torch.__version__}, Python {sys.version.split()[0]}, CPU; rank processes "
                           f"forked from a forkserver that imported the suite and fanfold once (`--start-method "
                           f"forkserver`), {os.environ['DISTRIBUTED_TESTS_DEFAULT_TIMEOUT']} s bound per test (the "
                           "harness's `DISTRIBUTED_TESTS_DEFAULT_TIMEOUT`, torch's default)",
            "bound": os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"]}
    write_page(page, OUT, meta, SELECTION.format(count=len(collective_tests())))


def run_all(sizes: tuple[int, ...] = (2, 3, 8), limit: float = 3600.0) -> None:
    """Both backends at each size (8: where the suite's ``_group`` tests run), each in its own interpreter
    (``WORLD_SIZE`` is read when the suite is imported), each bounded by ``limit`` seconds; then the page."""
    for size in sizes:
        for backend in ("gloo", "fanfold"):
            subprocess.run([sys.executable, __file__, "--backend", backend, "--world-size", str(size)], check=True,
                           timeout=limit)
    report(ROOT / "docs" / "conformance-backend.md")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "fanfold"))
    parser.add_argument("--only", nargs="+", metavar="TEST")
    parser.add_argument("--keep", action="store_true", help="with --only: keep the other tests' results in the file")
    parser.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                        help="how rank processes start: forkserver (default, faster) or spawn (torch's way)")
    parser.add_argument("--world-size", type=int, default=2, choices=range(2, 9), metavar="{2..8}",
                        help="ranks per test (default 2; torch's _group tests need 8)")
    parser.add_argument("--report", action="store_true", help="write docs/conformance-backend.md from the runs")
    parser.add_argument("--all", action="store_true", help="both backends at 2, 3 and 8 ranks, then --report")
    args = parser.parse_args()
    if args.report:
        report(ROOT / "docs" / "conformance-backend.md")
        return 0
    if args.all:
        run_all()
        return 0
    if args.backend is None:
        parser.error("--backend, --all or --report")
    OUT.mkdir(parents=True, exist_ok=True)
    run(args.backend, args.only or collective_tests(), OUT / f"{args.backend}-{args.world_size}.json", args.keep,
        args.start_method)
    return 0


if __name__ == "__main__":
    sys.exit(main())
