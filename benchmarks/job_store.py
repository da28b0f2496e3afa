"""The job's authenticated store against torch's TCPStore, and against another version's job store: connect time and
request round trips, side by side in one run.

    .venv/bin/python benchmarks/job_store.py                        # 5 runs x 2,000 requests of each kind
    .venv/bin/python benchmarks/job_store.py --old main --runs 7    # and the job store of revision `main`
    .venv/bin/python benchmarks/job_store.py --quick --no-page      # 2 runs x 200; print only

Each measure is a fresh interpreter whose ``PYTHONPATH`` puts one version's ``src`` first (this tree's, or ``git
archive REV src`` for ``--old REV``); it hosts the server, as ``fanfold run``'s agent or ``fanfold.launch``'s parent
does, and spawns the client, as a worker is. A run measures every row once, the order rotated from one run to the
next: the time of a process's first connection (with what it loads then only: for the sealed job store, the
cipher's module), the median of 20 more (the handshake, and the session keys where the version seals its traffic),
then set, get and add round trips of 64-byte values on the last; the table shows the median over runs of each run's
median. Collectives never touch the store; what uses it per step is at most the stall
inspector's progress record (one set every 50 ms at most, from a background thread). The block goes into
docs/benchmarks.md and docs/reliability.md (between their ``job-store`` markers) unless ``--no-page``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import timedelta
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "reliability.md"]
sys.path.insert(0, str(ROOT / "tools"))
from docscheck.generated import write_block  # noqa: E402  (tools/docscheck/generated.py: the sealed block)

SECRET = b"0123456789abcdef" * 4


def _client(kind: str, port: int, n: int, conn) -> None:
    import torch.distributed as dist

    from fanfold._core.job import JobStore

    def connect():
        if kind == "TCPStore":
            return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        return JobStore("127.0.0.1", port, SECRET, timedelta(seconds=30))

    t0 = time.perf_counter()
    stores = [connect()]  # with what a process loads on its first connection only (the cipher's module)
    out = {"connect": time.perf_counter() - t0}
    again = []
    for _ in range(20):
        t = time.perf_counter()
        stores.append(connect())
        again.append(time.perf_counter() - t)
    out["again"] = statistics.median(again)
    store = stores[-1]
    value = b"x" * 64
    for op in ("set", "get", "add"):
        times = []
        for i in range(n):
            t = time.perf_counter()
            if op == "set":
                store.set(f"k{i}", value)
            elif op == "get":
                store.get(f"k{i}")
            else:
                store.add("counter", 1)
            times.append(time.perf_counter() - t)
        out[op] = statistics.median(times)
    conn.send(out)


def one(kind: str, n: int) -> dict:
    """One measure in this interpreter: the server here, the client in a spawned process."""
    import torch.distributed as dist

    if kind == "TCPStore":
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    else:
        from fanfold._core.job import StoreServer

        server = StoreServer(SECRET)
    recv, send = mp.get_context("spawn").Pipe(duplex=False)
    p = mp.get_context("spawn").Process(target=_client, args=(kind, server.port, n, send))
    p.start()
    out = recv.recv()
    p.join(timeout=60)
    if kind != "TCPStore":
        server.close()
    return out


def _source(rev: str, into: Path) -> Path:
    """``src`` of revision ``rev``, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def _measure(src: Path, kind: str, n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, __file__, "--one", kind, "--requests", str(n)], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the {kind} measure with {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def block(rows: dict[str, list[dict]], command: str, runs: int, n: int, load: tuple[float, float]) -> str:
    import torch

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [f"Run of {when} on commit {commit}: `{command}`, torch {torch.__version__}, Python "
             f"{platform.python_version()}, {os.cpu_count()} CPUs, load average {load[0]:.1f} at the start and "
             f"{load[1]:.1f} at the end; {runs} runs x {n} requests of each kind, the order of the rows rotated from "
             "one run to the next; medians over runs of each run's median.", "",
             "| store | first connect (ms) | connect, next 20 (ms) | set (us) | get (us) | add (us) |",
             "|---|---|---|---|---|---|"]
    for label, results in rows.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        lines.append(f"| {label} | {med['connect'] * 1e3:.2f} | {med['again'] * 1e3:.2f} | {med['set'] * 1e6:.0f} | "
                     f"{med['get'] * 1e6:.0f} | {med['add'] * 1e6:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="2 runs x 200 requests")
    parser.add_argument("--old", metavar="REV", help="also measure the job store of this git revision")
    parser.add_argument("--no-page", action="store_true", help="print the block only; leave the docs as they are")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one measure, in the interpreter the run starts
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.requests)))
        return
    runs, n = (2, 200) if args.quick else (args.runs, args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        new = ROOT / "src"
        kinds = {"TCPStore (torch, C++, no authentication)": (new, "TCPStore"),
                 "JobStore (fanfold, this tree: sealed channel)": (new, "JobStore")}
        if args.old:
            kinds[f"JobStore (fanfold, {args.old})"] = (_source(args.old, Path(tmp)), "JobStore")
        rows: dict[str, list[dict]] = {label: [] for label in kinds}
        before = os.getloadavg()[0]
        for r in range(runs):
            labels = list(kinds)
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                rows[label].append(_measure(*kinds[label], n))
    command = "python benchmarks/job_store.py" + ("" if not args.quick else " --quick") + \
        ("" if args.quick else f" --runs {runs} --requests {n}") + (f" --old {args.old}" if args.old else "")
    text = block(rows, command, runs, n, (before, os.getloadavg()[0]))
    if not args.no_page:
        for page in PAGES:
            write_block(page, "job-store", command, text)
    print(text)


if __name__ == "__main__":
    main()
