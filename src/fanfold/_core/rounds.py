"""A key space of its own for each round of workers in torchrun's shared store.

torch's elastic agent (torchrun, torch >= 2.4) lets the workers use the TCPStore of its rendezvous
(``TORCHELASTIC_USE_AGENT_STORE=True``), and that store lives as long as the agent: the workers of a restarted round
find every key the round before them wrote, under the same names. gloo's rendezvous then reads a dead peer's address
before the live peer overwrites it, and the pair waits in gloo's connect (or fails, connection refused). No
environment variable tells a worker which round it belongs to (``TORCHELASTIC_RESTART_COUNT`` differs between nodes
after a restart: only the agent whose worker failed counts it), so the round is named here: rank 0 draws a token and
publishes it; every other rank learns it under its own fresh nonce and takes it only once rank 0 acknowledged that
nonce under that token, a key nobody wrote before. A stale token is never acknowledged (its rank 0 is gone): the rank
reads the token again until this round's rank 0 has published its own.
"""
from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta

import torch.distributed as dist

SHARED_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # "True": MASTER_ADDR:MASTER_PORT is the agent's own store
ROUND_KEY = "fanfold/round"
_POLL_S = (0.002, 0.1)  # first and longest pause between two looks at the store


def agent_store_shared() -> bool:
    """True in a worker of torch's elastic agent whose store outlives the round (torchrun's default)."""
    return os.environ.get(SHARED_STORE_ENV) == str(True)


def _pause(delay: float) -> float:
    time.sleep(delay)
    return min(delay * 2, _POLL_S[1])


def round_store(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.PrefixStore:
    """``store`` seen under a prefix that only this round's ranks share; raises ``DistStoreError`` naming the ranks
    that did not come within ``timeout``. Every rank of the round calls it once, at the rendezvous."""
    deadline = time.monotonic() + timeout.total_seconds()
    delay = _POLL_S[0]
    if rank == 0:
        token = secrets.token_hex(16)
        store.set(ROUND_KEY, token)
        pending = set(range(1, world_size))
        while pending:
            arrived = [r for r in sorted(pending) if store.check([f"{ROUND_KEY}/{token}/nonce/{r}"])]
            for r in arrived:
                nonce = store.get(f"{ROUND_KEY}/{token}/nonce/{r}").decode()
                store.set(f"{ROUND_KEY}/{token}/ack/{r}/{nonce}", "1")
                pending.discard(r)
            if pending and not arrived:
                if time.monotonic() > deadline:
                    raise dist.DistStoreError(
                        f"fanfold rendezvous: rank(s) {sorted(pending)} of {world_size} did not reach "
                        f"init_process_group within {timeout.total_seconds():g} s")
                delay = _pause(delay)
        return dist.PrefixStore(f"{ROUND_KEY}/{token}/", store)
    nonce, token = secrets.token_hex(16), None
    while True:
        if store.check([ROUND_KEY]):
            published = store.get(ROUND_KEY).decode()
            if published != token:  # the first token seen, or a later round's rank 0 replaced a stale one
                token = published
                store.set(f"{ROUND_KEY}/{token}/nonce/{rank}", nonce)
            if store.check([f"{ROUND_KEY}/{token}/ack/{rank}/{nonce}"]):
                return dist.PrefixStore(f"{ROUND_KEY}/{token}/", store)
        if time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"fanfold rendezvous: rank {rank} of {world_size} heard nothing from rank 0 within "
                f"{timeout.total_seconds():g} s (rank 0 did not reach init_process_group)")
        delay = _pause(delay)
