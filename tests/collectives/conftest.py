"""The collective layer's tests leave nothing in /dev/shm: every test is checked before and after."""
import time

import pytest

from fanfold.collectives.shm.segment import leftover_segments


@pytest.fixture(autouse=True)
def clean_dev_shm():
    before = set(leftover_segments())
    yield
    # Other test runs on this machine may be between creating and unlinking a segment (milliseconds): only a
    # name that stays is a leftover.
    deadline = time.monotonic() + 2.0
    while (new := set(leftover_segments()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not new, f"fanfold segments left in /dev/shm: {sorted(new)}"
