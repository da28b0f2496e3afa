"""The rank pool after a run cut short in the parent (pytest-timeout's SIGALRM, Ctrl-C): the ranks go on with that
configuration and send its results; the next configuration on the pool must get its own, judged against the
one-process oracle as usual.

The interruption is forced where the parent waits for the ranks' first message, as a test's timeout lands there
on a busy machine: a DDP configuration of the ``buffers`` family is sent (its forward changes a buffer it saved for
backward, so both implementations raise at step 0: "[torch.DoubleTensor [6]] is at version 1; expected version
0"), the wait raises, then ZeRO stage 2 runs on the same pool. Reading the first configuration's results as its
own, it would report that error as ZeRO's.
"""
from __future__ import annotations

import pytest

from . import pool as pool_module
from .compare import classify
from .config import DDPConfig, ZeroConfig
from .pool import RankPool
from .runner import GRACE, TIMEOUT

# test_ddp.py draws it (no buffer broadcast at construction: the buffer is at version 0 when the forward saves it)
BUFFERS = DDPConfig(family="buffers", keywords=(("broadcast_buffers", False),))


class Interrupted(Exception):
    """What the parent's timeout raises in the middle of a run."""


def test_a_run_cut_short_leaves_nothing_to_the_next_configuration(monkeypatch):
    pool = RankPool(2)
    cut: list = []  # the ranks the interrupted run was sent to
    try:
        def wait(*args, **kwargs):
            cut.extend(pool._procs)
            raise Interrupted("the test's time limit, inside the pool's wait for the ranks")

        with monkeypatch.context() as m:
            m.setattr(pool_module, "wait", wait)
            with pytest.raises(Interrupted):
                pool.run(BUFFERS, TIMEOUT, GRACE)
        assert len(cut) == 2 and not any(p.is_alive() for p in cut), "the cut run's ranks are still running"
        config = ZeroConfig(stage=2)
        outcome = classify(config, pool.run(config, TIMEOUT, GRACE))
        assert outcome.kind == "match-oracle", outcome.detail
    finally:
        pool.close()
