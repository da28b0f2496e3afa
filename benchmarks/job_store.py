"""The job's authenticated store against torch's TCPStore: connect time and request round trips, side by side.

    .venv/bin/python benchmarks/job_store.py            # 5 runs x 2,000 requests of each kind
    .venv/bin/python benchmarks/job_store.py --quick    # 2 runs x 200

Both servers live in this process (as under ``fanfold run``'s agent or ``fanfold.launch``'s parent); the client is
another process, as a worker is. A run measures, alternating the two stores: the time to connect (for the job's
store: the challenge and response), then set, get and add round trips of 64-byte values; the table shows the median
over runs of each run's median. Collectives never touch the store; what uses it per step is at most the stall
inspector's progress record (one set every 50 ms at most, from a background thread).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from datetime import timedelta

import torch.distributed as dist

from fanfold._core.job import JobStore, StoreServer

SECRET = b"benchmark secret"


def _client(kind: str, port: int, n: int, conn) -> None:
    t0 = time.perf_counter()
    if kind == "TCPStore":
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    else:
        store = JobStore("127.0.0.1", port, SECRET, timedelta(seconds=30))
    out = {"connect": time.perf_counter() - t0}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    runs, n = (2, 200) if args.quick else (args.runs, args.requests)
    ctx = mp.get_context("spawn")
    results: dict[str, list[dict]] = {"TCPStore": [], "JobStore": []}
    for _ in range(runs):
        for kind in results:
            if kind == "TCPStore":
                server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
                port = server.port
            else:
                server = StoreServer(SECRET)
                port = server.port
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_client, args=(kind, port, n, send))
            p.start()
            results[kind].append(recv.recv())
            p.join()
            if kind == "JobStore":
                server.close()
            del server
    print(f"| store | connect (ms) | set (us) | get (us) | add (us) |  ({runs} runs x {n} requests, medians)")
    print("|---|---|---|---|---|")
    for kind, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {kind} | {med['connect'] * 1e3:.2f} | {med['set'] * 1e6:.0f} | {med['get'] * 1e6:.0f} | "
              f"{med['add'] * 1e6:.0f} |")


if __name__ == "__main__":
    main()
