"""torch's own collective tests (``DistributedTest._DistTestBase``, CPU, 2 or 3 ranks) on gloo and on ``fanfold``.

    python conformance/collectives.py --backend gloo     # build/conformance-backend/gloo-2.json
    python conformance/collectives.py --backend fanfold  # every rank's gloo groups become fanfold groups
    python conformance/collectives.py --backend fanfold --world-size 3 --only test_all_gather test_barrier
    python conformance/collectives.py --report           # docs/conformance-backend.md from every size run

The suite is set up as torch's own driver does (``BACKEND=gloo``, ``WORLD_SIZE`` from ``--world-size``, default 2;
``TestDistBackend`` spawning fresh rank processes per test), so the suite takes the same decisions (skips,
expectations) in both runs. With ``--backend fanfold`` each rank process, when it imports this module, rebinds
``torch.distributed``'s ``init_process_group`` and ``new_group`` so that a gloo group is created as a ``fanfold``
one: the only difference between the two runs is the backend under the collectives. Tests are those whose names
name a collective, without DDP and GPU ones. Every collective the backend runs in shared memory is covered:
all_reduce (and coalesced), broadcast, barrier and all_gather by the suite's tests; all_to_all_single (which the
suite runs on CPU with MPI only), all_gather_into_tensor and reduce_scatter_tensor (CUDA only there) by the suite's
own helpers called with CPU tensors (``cpu_collectives.py``).
Layer: a tool beside the package (imports ``fanfold`` only to register the backend).
"""
from __future__ import annotations

import argparse
import json
import os
import re
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
SWAP_ENV = "FANFOLD_CONFORMANCE_BACKEND"
START_ENV = "FANFOLD_CONFORMANCE_START"
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "conformance-backend"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from cpu_collectives import CpuCollectives  # noqa: E402 - after WORLD_SIZE is set
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


class TestDistBackendCollectives(CpuCollectives, TestDistBackend, DistributedTest._DistTestBase):
    """The suite's tests in fresh rank processes per test. torch's harness spawns each rank (a new interpreter
    importing torch and the suite: seconds per rank and test); with ``START_ENV=forkserver`` the ranks are forked
    from one server that imported the suite and fanfold once, and take the environment the parent had when it
    started the test from ``<file_name>.env`` (the harness sets ``TEMP_DIR`` and ``INIT_METHOD`` anew per test)."""

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
        context.set_forkserver_preload([distributed_test.__name__, "fanfold"])
        self._start_processes(context.Process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe, **kwargs) -> None:
        # in the rank process, before the process group and the test
        with open(file_name + ".env") as f:
            environ = json.load(f)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(1)  # a few small tensors per test: no thread pool per rank on a shared machine
        if os.environ.get(SWAP_ENV) == "fanfold":
            use_fanfold()
        super()._run(rank, test_name, file_name, pipe, **kwargs)


def run(backend: str, tests: list[str], path: Path, keep: bool = False, start: str = "forkserver") -> dict:
    """Run ``tests`` on ``backend``, rewriting ``path`` after each (a run cut short keeps what it had); with
    ``keep``, the results already in ``path`` for other tests stay (a rerun of a few). ``start``: how rank
    processes start, "spawn" (torch's way) or "forkserver" (faster)."""
    os.environ[SWAP_ENV] = backend  # the ranks read it when they start
    os.environ[START_ENV] = start
    results = json.loads(path.read_text()) if keep and path.exists() else {}
    for name in tests:
        suite = unittest.TestSuite([TestDistBackendCollectives(name)])
        result = unittest.TestResult()
        t0 = time.monotonic()
        suite.run(result)
        status = ("fail" if result.failures or result.errors else "skip" if result.skipped else "pass")
        detail = "".join(tb for _, tb in result.failures + result.errors)[-600:] or (
            result.skipped[0][1] if result.skipped else "")
        results[name] = {"status": status, "seconds": round(time.monotonic() - t0, 1), "detail": detail}
        print(f"{backend} {name}: {status}", flush=True)
        path.write_text(json.dumps(results, indent=1))
    return results


def report(page: Path) -> None:
    sizes = sorted(int(p.stem.split("-")[1]) for p in OUT.glob("gloo-*.json")
                   if (OUT / f"fanfold-{p.stem.split('-')[1]}.json").exists())
    if not sizes:
        raise SystemExit(f"run both backends first (no gloo-N.json and fanfold-N.json pair in {OUT})")
    lines = ["# Conformance: torch's collective tests on the `fanfold` backend", "",
             "torch's own `DistributedTest._DistTestBase` collective tests (CPU), run by "
             "`conformance/collectives.py` with gloo and with every gloo group created as a `fanfold` group "
             f"(harness bound per test: {os.environ['DISTRIBUTED_TESTS_DEFAULT_TIMEOUT']} s; a test that overruns it "
             "fails). A test passes on fanfold where it passes on gloo unless the table says otherwise."]
    for size in sizes:
        lines += ["", f"## {size} ranks", ""] + _table(
            {b: json.loads((OUT / f"{b}-{size}.json").read_text()) for b in ("gloo", "fanfold")})
    page.write_text("\n".join(lines) + "\n")


def _table(runs: dict) -> list[str]:
    tests = sorted(set(runs["gloo"]) | set(runs["fanfold"]))
    count = {b: {s: sum(r.get(t, {}).get("status") == s for t in tests) for s in ("pass", "fail", "skip")}
             for b, r in runs.items()}
    lines = ["| backend | pass | fail | skip |", "|---|---|---|---|"]
    lines += [f"| {b} | {c['pass']} | {c['fail']} | {c['skip']} |" for b, c in count.items()]
    lines += ["", "| test | gloo | fanfold | note |", "|---|---|---|---|"]
    for t in tests:
        g, f = runs["gloo"].get(t, {}), runs["fanfold"].get(t, {})
        shown = f if f.get("status") != "pass" else g  # why fanfold's did not pass, else why gloo's did not
        lines_of = shown.get("detail", "").strip().splitlines()
        errors = [x for x in lines_of if re.search(r"Error|Exception", x)] or lines_of  # not torch's repro hint
        note = errors[-1:] if "fail" in (g.get("status"), f.get("status")) else []
        lines.append(f"| {t} | {g.get('status', '-')} | {f.get('status', '-')} | "
                     f"{(note[0] if note else '').replace('|', '/')[:160]} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "fanfold"))
    parser.add_argument("--only", nargs="+", metavar="TEST")
    parser.add_argument("--keep", action="store_true", help="with --only: keep the other tests' results in the file")
    parser.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                        help="how rank processes start: forkserver (default, faster) or spawn (torch's way)")
    parser.add_argument("--world-size", type=int, default=2, choices=(2, 3), help="ranks per test (default 2)")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.report:
        report(ROOT / "docs" / "conformance-backend.md")
        return 0
    if args.backend is None:
        parser.error("--backend or --report")
    OUT.mkdir(parents=True, exist_ok=True)
    run(args.backend, args.only or collective_tests(), OUT / f"{args.backend}-{args.world_size}.json", args.keep,
        args.start_method)
    return 0


if __name__ == "__main__":
    sys.exit(main())
