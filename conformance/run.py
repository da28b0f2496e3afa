"""`make conformance`: torch's own DDP tests, with torch's DDP and then with fanfold's, into docs/conformance.md.

    python conformance/run.py                       # select, run twice, write docs/conformance.md
    python conformance/run.py --only test_ddp_logging_data_cpu test_DistributedDataParallelCPU
    python conformance/run.py --report-only         # rewrite the page from the last run's results
    python conformance/run.py --cuda-on-cpu         # the CPU port: the same tests, the suite's CUDA devices mapped
                                                    # to the CPU (cuda_on_cpu.py); the page gets its section

Selects the DDP-related tests of torch's ``DistributedTest._DistTestBase`` (``selection.py``), checks the patching
from inside a rank process (``driver.py``'s ``SelfCheck``), then runs the list with ``driver.py --ddp torch`` and
``driver.py --ddp fanfold`` (CPU, gloo, 2 ranks). Raw results and logs go to ``build/conformance/`` (not in git),
the CPU port's to ``build/conformance/cuda-on-cpu/``; the page shows the last run of each.

Every test is bounded twice: by the harness (``--timeout``, it terminates the test's rank processes) and by this
runner, which kills the driver's whole process group when a test overruns by a minute more, records a timeout and
starts a new driver on the remaining tests. The driver runs in its own session and that process group is killed when
the driver ends, so no rank process outlives the run.

Layer: a tool beside the package: selection.py and driver.py below it, reasons.py (the investigated causes) and
report.py (the page) beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from report import Outcome, revision, write_page
from selection import ddp_tests

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("driver.py")
GRACE = 60  # seconds the runner adds to the harness's own per-test bound before killing the driver
SELF_CHECK = "SelfCheck.test_ddp_names_in_rank"
PORT = "cuda-on-cpu"  # the CPU port's results: a folder of --out


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the driver's process group (its rank processes and multiprocessing helpers with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _log_tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def run_tests(impl: str, tests: list[str], stem: Path, timeout: int, start_method: str, driver: Path = DRIVER,
              grace: float = GRACE, driver_args: tuple[str, ...] = ()) -> dict[str, Outcome]:
    """Run ``tests`` with ``impl``'s DDP in as many ``driver`` processes as it takes, recording into ``stem``.jsonl
    (and the drivers' output into ``stem``.log); one Outcome per test. A test still running ``timeout + grace``
    seconds after it started is recorded as a timeout and its driver's process group killed."""
    results, log = stem.with_suffix(".jsonl"), stem.with_suffix(".log")
    results.unlink(missing_ok=True)
    log.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    # the suite's process groups time out after 60 s (distributed_test.default_pg_timeout): the same for fanfold's
    env.setdefault("FANFOLD_STALL_TIMEOUT", "60")
    done: dict[str, Outcome] = {}
    while remaining := [t for t in tests if t not in done]:
        cmd = [sys.executable, str(driver), "--ddp", impl, "--results", str(results), "--timeout", str(timeout),
               "--start-method", start_method, *driver_args, *remaining]
        with open(log, "a") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
        current, since = None, time.monotonic()
        try:
            while proc.poll() is None:
                time.sleep(1)
                current, since = _progress(results, done, current, since)
                if current is not None and time.monotonic() - since > timeout + grace:
                    _record(results, done, Outcome(current, "timeout", round(time.monotonic() - since),
                                                   f"killed by the runner after {timeout + grace:g} s (the harness's "
                                                   f"own {timeout} s bound did not end it)"))
                    break
        finally:
            _kill_group(proc)
        current, _ = _progress(results, done, current, since)
        if current is not None and current not in done:  # the driver died inside a test
            _record(results, done, Outcome(current, "fail", 0, f"the driver exited with {proc.returncode} inside "
                                           f"this test; its log ends:\n{_log_tail(log)}"))
        elif current is None and remaining == [t for t in tests if t not in done]:
            raise RuntimeError(f"the {impl} driver ran no test (exit {proc.returncode}); its log {log} ends:\n"
                               f"{_log_tail(log)}")
    return done


def _record(results: Path, done: dict[str, Outcome], outcome: Outcome) -> None:
    """An outcome the runner decided (the driver could not write it): kept with the driver's."""
    done[outcome.test] = outcome
    with open(results, "a") as f:
        f.write(json.dumps(outcome.as_record()) + "\n")


def _progress(results: Path, done: dict[str, Outcome], current: str | None, since: float) -> tuple:
    """Fold new records into ``done``; the test now running (None when none) and since when it runs."""
    started = None
    for r in _records(results):
        if "event" in r:
            started = r["test"]
        elif r["test"] not in done:
            done[r["test"]] = Outcome.from_record(r)
    running = started if started is not None and started not in done else None
    if running != current:
        since = time.monotonic()
    return running, since


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="TEST", help="run these tests instead of the whole selection")
    parser.add_argument("--timeout", type=int, default=150, help="seconds per test (default 150)")
    parser.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                        help="how rank processes start (driver.py; default forkserver)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "conformance", help="raw results and logs")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "conformance.md")
    parser.add_argument("--report-only", action="store_true", help="rewrite the page from the last results")
    parser.add_argument("--cuda-on-cpu", action="store_true",
                        help=f"the CPU port: the suite's CUDA devices mapped to the CPU in every rank "
                             f"(cuda_on_cpu.py); results in <out>/{PORT}")
    args = parser.parse_args(argv)
    selected = ddp_tests()
    tests = args.only or selected
    unknown = sorted(set(tests) - set(selected))
    if unknown:
        raise SystemExit(f"not in the DDP selection: {unknown}")
    port = args.out / PORT
    here = port if args.cuda_on_cpu else args.out
    if not args.report_only:
        here.mkdir(parents=True, exist_ok=True)
        meta = _run_both(here, tests, args, ("--cuda-on-cpu",) if args.cuda_on_cpu else (),
                         " ".join(["python", "conformance/run.py", *(argv if argv is not None else sys.argv[1:])]))
        (here / "runs.json").write_text(json.dumps(meta, indent=1))
    plain, ported = _load(args.out), _load(port)
    if plain is None:
        raise SystemExit(f"no results in {args.out}: run `python conformance/run.py` (without --report-only or "
                         "--cuda-on-cpu) first; the page starts with that run")
    write_page(args.page, plain[0], selected, plain[1], port=ported)
    print(f"wrote {args.page}")
    return 0


def _run_both(out: Path, tests: list[str], args: argparse.Namespace, driver_args: tuple[str, ...],
              command: str) -> dict:
    """The self-check, then ``tests`` with torch's DDP and with fanfold's, into ``out``; the run's metadata."""
    meta = {"command": command, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tests": tests,
            "seconds": {}, "start_method": args.start_method, "revision": revision(ROOT),
            "transport": os.environ.get("FANFOLD_TRANSPORT") or "default"}
    for impl in ("torch", "fanfold"):
        check = run_tests(impl, [SELF_CHECK], out / f"selfcheck-{impl}", args.timeout, args.start_method,
                          driver_args=driver_args)
        if check[SELF_CHECK].status != "pass":
            raise SystemExit(f"the self-check failed with {impl}'s DDP (see {out}/selfcheck-{impl}.log):\n"
                             f"{check[SELF_CHECK].detail}")
    for impl in ("torch", "fanfold"):
        t0 = time.monotonic()
        outcomes = run_tests(impl, tests, out / impl, args.timeout, args.start_method, driver_args=driver_args)
        meta["seconds"][impl] = round(time.monotonic() - t0)
        print(f"{impl}: " + ", ".join(f"{s} {sum(o.status == s for o in outcomes.values())}"
                                      for s in ("pass", "fail", "timeout", "skip")), flush=True)
    return meta


def _load(out: Path) -> tuple[dict, dict[str, dict[str, Outcome]]] | None:
    """A run's metadata and its outcomes by DDP and test, from ``out``; None when it holds no run."""
    if not (out / "runs.json").exists():
        return None
    return json.loads((out / "runs.json").read_text()), {
        impl: {r["test"]: Outcome.from_record(r) for r in _records(out / f"{impl}.jsonl") if "status" in r}
        for impl in ("torch", "fanfold")}


if __name__ == "__main__":
    sys.exit(main())
