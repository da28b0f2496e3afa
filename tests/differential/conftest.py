"""One ``Runner`` (pools of rank processes, one per world size) for the whole session: the ranks are started once
and reused by every configuration of every differential test."""
import pytest

from .runner import Runner


@pytest.fixture(scope="session")
def runner():
    r = Runner()
    yield r
    r.close()
