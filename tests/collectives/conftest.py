"""The collective layer's tests leave nothing in /dev/shm: every test is checked for the segments its own processes
made (other jobs on the machine have theirs there too, see tests/_shm_watch.py)."""
import pytest

from _shm_watch import OwnSegments


@pytest.fixture(autouse=True)
def clean_dev_shm():
    with OwnSegments() as segments:
        yield
        left = segments.left()
    assert not left, f"fanfold segments left in /dev/shm by this test's processes: {left}"
