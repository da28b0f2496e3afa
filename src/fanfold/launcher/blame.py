"""Who ended a failed ``fanfold run``: the root cause among the failed workers of a ``ChildFailedError`` (torch's
agent's), told apart from the ranks that failed because a peer was gone and those the agent stopped itself.
docs/launching.md, "Failures"."""
from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Blame:
    """Who ended a failed run (a ``ChildFailedError``'s failures, by global rank): ``root``, the rank that failed
    first on its own; ``consequences``, ranks that failed because a peer was gone (rank -> the peers, [] unknown);
    ``stopped``, ranks the agent stopped; ``later``, ranks that failed on their own after ``root``."""

    root: int
    failure: object  # the root's ProcessFailure
    consequences: dict[int, list[int]] = field(default_factory=dict)
    stopped: list[int] = field(default_factory=list)
    later: list[int] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        code = self.failure.exitcode
        return code if code > 0 else 128 + (-code or 1)


def error_info(failure) -> dict | None:
    """The worker shim's record in ``failure``'s error file (message, traceback, time_ns, peer_gone), or None."""
    info = failure.error_file_data.get("message")
    return info if isinstance(info, dict) and isinstance(info.get("extraInfo"), dict) else None


def blame(err, stopped: Mapping[int, int] | None = None) -> Blame:
    """The root cause of a failed run and the role of every other failed rank. ``stopped``: pid -> time.time_ns()
    at which the agent signalled that worker to stop (None: the agent's records are unknown, and a worker that
    ended by SIGTERM with no exception of its own counts as stopped).

    Why not the agent's order: on a loaded machine it polls late, and a dead rank's peer (whose collective failed on
    the dead connection, or which the agent then stopped) can end before the agent sees the death. So: a worker the
    agent signalled, with no exception of its own before that, was stopped; a worker whose exception names a gone
    peer (the worker shim records it) failed as a consequence; of the rest, the first to fail is the root cause, by
    the worker's own clock (its error file), or for a death with no error file (a signal, ``os._exit``) by when the
    agent saw it: at the start of that second, as the death may have been earlier within it."""
    roles: dict[str, dict[int, object]] = {"stopped": {}, "consequence": {}, "own": {}}
    # A rank that a peer's failure names as gone was dead before that failure: it died on its own, even where the
    # agent, seeing the peer's failure first, signalled it too (its process not yet reaped).
    named_gone = {r for f in err.failures.values() if (i := error_info(f))
                  for r in i["extraInfo"].get("peer_gone") or ()}
    for rank, failure in err.failures.items():
        info = error_info(failure)
        raised_ns = int(info["extraInfo"].get("time_ns", 0)) if info else None
        signalled_ns = (stopped or {}).get(failure.pid)
        if rank in named_gone and info is None:
            was_stopped = False
        elif stopped is None:
            was_stopped = failure.exitcode == -signal.SIGTERM and info is None
        else:  # its exception, if any, came after the stop: the stop's (a handler that raised on SIGTERM)
            was_stopped = signalled_ns is not None and (raised_ns is None or raised_ns >= signalled_ns)
        role = ("stopped" if was_stopped else
                "consequence" if info is not None and "peer_gone" in info["extraInfo"] else "own")
        roles[role][rank] = failure

    def when(item: tuple) -> tuple:
        rank, failure = item
        info = error_info(failure)
        if info is not None and "time_ns" in info["extraInfo"]:
            return int(info["extraInfo"]["time_ns"]), rank
        return failure.timestamp * 10**9, rank

    # no failure of its own anywhere (e.g. a rank that exited 0 early, its peers failing without it): the first
    # consequence; then anything
    pool = roles["own"] or roles["consequence"] or err.failures
    root, first = min(pool.items(), key=when)
    return Blame(
        root=root, failure=first,
        consequences={r: list(error_info(f)["extraInfo"]["peer_gone"]) for r, f in roles["consequence"].items()
                      if r != root},
        stopped=sorted(r for r in roles["stopped"] if r != root),
        later=sorted(r for r in roles["own"] if r != root),
    )
