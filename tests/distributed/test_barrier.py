"""The barriers name a rank that never comes: ``fanfold.distributed.barrier()`` (on gloo and on the ``fanfold``
backend) and the ``fanfold`` backend's own ``dist.barrier()`` (through its shared memory, and with
``FANFOLD_TRANSPORT=torch``, where gloo's barrier alone would say "Timed out waiting ... for recv" naming nobody).
Three ranks, rank 2 alive but skipping the barrier: ranks 0 and 1 raise :class:`fanfold.StallError` with
``missing == [2]`` within the stall timeout. A barrier all ranks reach first shows that it waits for the last one."""
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import fanfold
import fanfold.distributed as fd

STALL = 2.0


def _skip_one(backend, which):
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    barrier = fd.barrier if which == "fanfold.distributed" else dist.barrier
    r, out = dist.get_rank(), {}
    if r == 1:
        time.sleep(0.5)  # the last to come: the others must wait for it
    start = time.monotonic()
    barrier()
    out["waited"] = time.monotonic() - start
    store = dist.distributed_c10d._get_default_store()
    if r == 2:  # alive, skips the next barrier, leaves once both others have given up
        deadline = time.monotonic() + 60
        while store.add("test/gave up", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return out
    start = time.monotonic()
    try:
        barrier()
        out["alone"] = None
    except fanfold.StallError as exc:
        out["alone"] = (str(exc), exc.missing, time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - a wrong type fails the test, with its message
        out["alone"] = (f"{type(exc).__name__}: {exc}", None, time.monotonic() - start)
    store.add("test/gave up", 1)
    return out


@pytest.mark.parametrize("backend,which,transport", [
    ("gloo", "fanfold.distributed", None),
    ("fanfold", "fanfold.distributed", None),
    ("fanfold", "torch", None),
    ("fanfold", "torch", "torch"),
])
def test_a_rank_that_never_comes_is_named(backend, which, transport):
    env = {"FANFOLD_STALL_TIMEOUT": str(STALL)}
    if transport is not None:
        env["FANFOLD_TRANSPORT"] = transport
    out = fanfold.launch(_skip_one, backend, which, nprocs=3, timeout=120, env=env)
    assert out[0]["waited"] > 0.3 and out[2]["waited"] > 0.3, out  # the first barrier waited for rank 1
    for r in (0, 1):
        message, missing, waited = out[r]["alone"]
        assert missing == [2], (r, message)
        assert "rank 2" in message or "ranks [2]" in message, (r, message)
        assert waited < STALL + 10, (r, waited)
