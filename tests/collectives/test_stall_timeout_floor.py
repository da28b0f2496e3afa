"""A stall timeout below the least one in which a stall can be diagnosed (0.1 s: peers publish their progress every
0.05 s) is refused, from every place it can come from, with a message naming the value, the minimum and the place;
and the waits whose timeout message lists the late ranks never print an empty list: ranks that came just after the
deadline are not late."""
import json
from argparse import ArgumentParser
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fanfold
from fanfold.cli import run as run_cli
from fanfold.collectives.backend import FanfoldProcessGroup
from fanfold.collectives.select import host_views
from fanfold.collectives.shm.segment import Segment
from fanfold.collectives.stall import InspectedTransport
from fanfold.collectives.timeouts import resolve_stall_timeout
from fanfold.launcher import agent as launcher

TOO_SMALL = ["1e-9", "0.05", "0.0999"]


class _Never:
    def all_reduce(self, tensor, bucket=None, divisor=None):
        return torch.futures.Future()


@pytest.mark.parametrize("value", TOO_SMALL)
def test_a_stall_timeout_below_the_minimum_is_refused_naming_value_minimum_and_source(value, monkeypatch, tmp_path):
    why = rf"must be at least 0.1 s \(.*\), got {value!r}$"
    with pytest.raises(ValueError, match="^stall_timeout " + why):
        resolve_stall_timeout(value)
    if float(value) >= 1e-6:  # a timedelta's resolution: 1e-9 s is no time at all ("must be positive")
        with pytest.raises(ValueError, match="^stall_timeout must be at least 0.1 s .*, got 0.0"):
            resolve_stall_timeout(timedelta(seconds=float(value)))
    with pytest.raises(ValueError, match="^stall_timeout " + why), fanfold.stall_timeout(value):
        pass
    with pytest.raises(ValueError, match="^stall_timeout " + why):  # DDP's stall_timeout= reaches the inspector
        InspectedTransport(_Never(), timeout=value, store=dist.HashStore(), rank=0, world_size=2)
    with pytest.raises(ValueError, match="^stall_timeout " + why):
        launcher.launch_script([str(tmp_path / "missing.py")], stall_timeout=value)
    parser = ArgumentParser(prog="fanfold run")
    run_cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        run_cli.main(parser.parse_args(["--stall-timeout", value, "missing.py"]))
    monkeypatch.setenv("FANFOLD_STALL_TIMEOUT", value)
    with pytest.raises(ValueError, match="^FANFOLD_STALL_TIMEOUT " + why):
        resolve_stall_timeout()
    with pytest.raises(ValueError, match="^FANFOLD_STALL_TIMEOUT " + why):  # before any worker starts
        launcher.launch_script([str(tmp_path / "missing.py")])


def test_the_cli_names_its_flag(capsys):
    parser = ArgumentParser(prog="fanfold run")
    run_cli.add_arguments(parser)
    with pytest.raises(SystemExit) as exit_:
        run_cli.main(parser.parse_args(["--stall-timeout", "1e-9", "missing.py"]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("fanfold run: error: --stall-timeout must be at least 0.1 s") and "got '1e-9'" in err


def test_the_minimum_itself_is_taken(monkeypatch):
    assert resolve_stall_timeout(0.1) == 0.1
    monkeypatch.setenv("FANFOLD_STALL_TIMEOUT", "0.1")
    assert resolve_stall_timeout() == 0.1


class _LateStore:
    """A HashStore holding every key, whose first ``misses`` looks (check, wait) say they are not there yet: the
    ranks reported between a wait's end and the look that lists the late ones."""

    def __init__(self, keys, value, misses=1):
        self.store, self.misses = dist.HashStore(), misses
        for k in keys:
            self.store.set(k, value)

    def _miss(self):
        self.misses -= 1
        return self.misses >= 0

    def check(self, keys):
        return False if self._miss() else self.store.check(keys)

    def wait(self, keys, timeout=None):
        if self._miss():
            raise dist.DistStoreError("Wait timeout")
        self.store.wait(keys)

    def get(self, key):
        return self.store.get(key)

    def set(self, key, value):
        pass  # the test's keys are in already


def test_a_segment_whose_ranks_reported_just_after_the_deadline_names_no_late_rank():
    seg = Segment.__new__(Segment)  # only the fields the wait reads
    seg.rank, seg.world_size, seg.timeout = 0, 3, 1e-9
    store = _LateStore([f"attached/{r}" for r in range(3)], "ok")
    seg._wait_reports(store, deadline=0.0)  # every rank attached: no "ranks [] did not attach"


def test_host_views_whose_ranks_came_just_after_the_wait_name_no_late_rank():
    view = json.dumps([None, "host", True])
    store = _LateStore([str(r) for r in range(2)], view)
    assert host_views(store, 0, 2, None, True, wait=1e-3) == [[None, "host", True]] * 2


def test_a_store_barrier_whose_ranks_came_just_after_the_wait_passes(monkeypatch):
    pg = FanfoldProcessGroup.__new__(FanfoldProcessGroup)
    dist.ProcessGroup.__init__(pg, 0, 2)
    pg._store, pg._timeout, pg._barriers = _LateStore([f"fanfold/barrier/1/{r}" for r in range(2)], "1"), \
        timedelta(seconds=60), 0
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: _Prefixed(prefix, store))
    pg._store_barrier()  # no "waiting for ranks [], which never arrived"


class _Prefixed:
    def __init__(self, prefix, store):
        self.prefix, self.store = prefix, store

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(keys, *args):
            keys = [self.prefix + k for k in keys] if isinstance(keys, list) else self.prefix + keys
            return method(keys, *args)
        return call
