"""The multi-host tests run only under ``make multihost`` (root, several minutes: not part of ``make test``)."""
import os

import pytest
from hosts import unavailable

ENV_VAR = "FANFOLD_MULTIHOST"


def pytest_collection_modifyitems(config, items):
    reason = None if os.environ.get(ENV_VAR) else f"run by `make multihost` (sets {ENV_VAR}=1; needs root)"
    reason = reason or unavailable()
    if reason:
        skip = pytest.mark.skip(reason=f"simulated hosts: {reason}")
        for item in items:
            if "multihost" in item.path.parts:
                item.add_marker(skip)
