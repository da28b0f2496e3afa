"""One ``Runner`` (pools of rank processes, one per world size) for the whole session: the ranks are started once
and reused by every configuration of every differential test."""
import pytest
import torch

from .runner import Runner


@pytest.fixture(scope="session")
def runner():
    r = Runner()
    yield r
    r.close()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread while a test file runs (2 cores, shared), the caller's count given back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
