"""``round_store``: the ranks of a round share a key space no earlier round wrote to, in one long-lived TCPStore
(torchrun's agent store), whichever rank comes first; a missing rank is a DistStoreError naming it, in time."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fanfold._core.rounds import round_store

TIMEOUT = timedelta(seconds=60)


@pytest.fixture
def agent_store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    yield lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)


def _round(agent_store, world: int, delays: dict[int, float]) -> list[dist.Store]:
    stores, errors = [None] * world, []

    def rank(r: int) -> None:
        try:
            time.sleep(delays.get(r, 0.0))
            stores[r] = round_store(agent_store(), r, world, TIMEOUT)
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT.total_seconds())
    assert not errors and all(s is not None for s in stores), errors
    return stores


@pytest.mark.parametrize("late", [0, 1, 2])
def test_a_round_sees_none_of_the_previous_rounds_keys_whichever_rank_comes_last(agent_store, late):
    first = _round(agent_store, 3, {})
    for r, store in enumerate(first):
        store.set(f"address/{r}", "round 0")
    assert first[0].get("address/2") == b"round 0"  # one key space for the round's ranks
    # the ranks other than `late` read the store before `late` arrives, as gloo's rendezvous does
    second = _round(agent_store, 3, {late: 0.5})
    for store in second:
        assert not store.check([f"address/{r}" for r in range(3)])
    second[2].set("address/2", "round 1")
    assert second[0].get("address/2") == b"round 1"
    assert first[0].get("address/2") == b"round 0"


def test_a_rank_without_its_rank_0_fails_in_time_naming_it(agent_store):
    _round(agent_store, 2, {})  # a round whose token stays in the store, never to be acknowledged again
    began = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"rank 1 of 2 heard nothing from rank 0 within 0.5 s"):
        round_store(agent_store(), 1, 2, timedelta(seconds=0.5))
    assert time.monotonic() - began < 30


def test_rank_0_names_the_ranks_that_never_came(agent_store):
    with pytest.raises(dist.DistStoreError, match=r"rank\(s\) \[1, 2\] of 3 did not reach init_process_group"):
        round_store(agent_store(), 0, 3, timedelta(seconds=0.5))
