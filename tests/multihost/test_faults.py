"""Faults across simulated hosts (2 x 2 ranks): a rank killed on the remote host, the link taken down in the middle
of a collective. Every surviving rank, on both hosts, raises fanfold's StallError within a bounded time, and the
killed rank is named among the ranks that never arrived."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from hosts import Hosts, Link, wait_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
STALL_TIMEOUT = 15  # seconds: $FANFOLD_STALL_TIMEOUT of the ranks
PG_TIMEOUT = 20  # seconds: the process group's timeout, and so its store's (each read of a peer's progress)
ENV = {"FANFOLD_STALL_TIMEOUT": str(STALL_TIMEOUT), "FANFOLD_TEST_PG_TIMEOUT": str(PG_TIMEOUT)}


def _results(out, world: int, skip=()) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt") for r in range(world) if r not in skip]


def test_rank_killed_on_the_remote_host(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with Hosts(2) as hosts:
        ranks = hosts.start_ranks([2, 2], [sys.executable, WORKER, "kill", str(out)], str(tmp_path),
                                  env=ENV)
        wait_ranks(ranks, 180, may_fail=[3])
    assert ranks[3].proc.returncode != 0  # it really died
    for res in _results(out, 4, skip=[3]):
        err = res["error"]
        assert err is not None and err["type"] == "StallError", (res["rank"], err)
        assert 3 in err["missing"], (res["rank"], err["message"])
        assert "rank 3" in err["message"], err["message"]
        assert res["seconds"] < STALL_TIMEOUT + 10, (res["rank"], res["seconds"])


@pytest.fixture(scope="module")
def link_down(tmp_path_factory) -> dict[int, dict]:
    """Take host 1's link down during a 64 MiB all_reduce of 2 x 2 ranks; the results of the ranks that finished
    within the stall timeout + 60 s (the others are killed then)."""
    tmp = tmp_path_factory.mktemp("link")
    out, ready = tmp / "out", tmp / "started"
    out.mkdir()
    # 100 Mbit/s: the all_reduce takes several seconds, so it is under way when the link goes down
    with Hosts(2, link=Link(rate="100mbit", burst="64kb", latency="50ms")) as hosts:
        ranks = hosts.start_ranks([2, 2], [sys.executable, WORKER, "link", str(out), str(ready)], str(tmp), env=ENV)
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert time.monotonic() < deadline and all(r.proc.poll() is None for r in ranks), "the ranks never started"
            time.sleep(0.1)
        time.sleep(1.0)
        assert hosts.tx_bytes(0) > 2**20  # the collective is sending
        hosts.set_link(1, up=False)
        deadline = time.monotonic() + STALL_TIMEOUT + 60
        for r in ranks:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    return {r: torch.load(out / f"rank{r}.pt") for r in range(4) if (out / f"rank{r}.pt").exists()}


def _assert_diagnosed(results: dict[int, dict], rank: int) -> None:
    assert rank in results, f"rank {rank} gave no diagnosis within {STALL_TIMEOUT + 60} s of the link going down"
    res = results[rank]
    err = res["error"]
    assert err is not None and err["type"] == "StallError", (rank, err)
    assert f"did not complete within {STALL_TIMEOUT} s" in err["message"] or "failed" in err["message"], err
    # counted from the collective's start, a second or more before the link went down: within the stall timeout + 10 s
    # of the fault (the bound), whichever side of the link the rank is on
    assert res["seconds"] < STALL_TIMEOUT + 11, (rank, res["seconds"])


@pytest.mark.parametrize("rank", [0, 1])
def test_link_down_mid_collective_store_host(link_down, rank):
    """Host 0 (which holds the store): StallError within the stall timeout and a bounded diagnosis."""
    _assert_diagnosed(link_down, rank)


@pytest.mark.parametrize("rank", [2, 3])
def test_link_down_mid_collective_far_host(link_down, rank):
    """Host 1 (cut off from the store): StallError too, in bounded time (the diagnosis's store calls are bounded:
    over a dead link they block in TCP's retransmissions, far past the store's timeout)."""
    _assert_diagnosed(link_down, rank)
