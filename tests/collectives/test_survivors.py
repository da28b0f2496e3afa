"""The survivors' harness (``_survivors.run_surviving``) runs its ranks in the caller's environment of the moment:
its forkserver, started by an earlier test, would otherwise hand them the environment of that earlier moment (a
test's FANFOLD_STALL_TIMEOUT lost, so a stalled peer was waited for the group's 60 s instead of the test's 3 s)."""
import os

from _survivors import run_surviving


def _write_env(path):
    with open(path, "w") as f:
        f.write(os.environ.get("FANFOLD_SURVIVORS_PROBE", "<unset>"))


def test_ranks_see_the_callers_environment_of_the_call(tmp_path, monkeypatch):
    monkeypatch.delenv("FANFOLD_SURVIVORS_PROBE", raising=False)
    assert run_surviving(_write_env, (str(tmp_path / "before"),), 1, timeout=120) == [0]  # the forkserver is up
    monkeypatch.setenv("FANFOLD_SURVIVORS_PROBE", "set after the forkserver started")
    assert run_surviving(_write_env, (str(tmp_path / "after"),), 1, timeout=120) == [0]
    assert (tmp_path / "before").read_text() == "<unset>"
    assert (tmp_path / "after").read_text() == "set after the forkserver started"
