"""The rendezvous of ``fanfold run`` on one machine: this agent is node 0 of 1, its store an authenticated
``JobStore`` listening on 127.0.0.1 only, a fresh one every round. A handler for torch's elastic agent, registered by
``launch_script`` (imported there: torch's elastic package is not loaded by ``import fanfold``)."""
from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousParameters, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from .._core.job import JobStore, StoreServer, job_secret
from .spawn import LOOPBACK

__all__ = ["BACKEND", "LoopbackRendezvous"]

BACKEND = "fanfold-loopback"


class LoopbackRendezvous(StaticTCPRendezvous):
    """Rendezvous of a single node: this agent is node 0 of 1, the store's socket listens on 127.0.0.1 only."""

    def __init__(self, params: RendezvousParameters):
        super().__init__(LOOPBACK, 0, 0, 1, params.run_id, params.get_as_int("timeout", 900))
        # from the environment launch_script set up, never from params: torch logs its launch config
        self._secret, self._server = job_secret(), None

    def get_backend(self) -> str:
        return BACKEND  # torch checks the handler's backend against the one it asked the registry for

    def next_rendezvous(self) -> RendezvousInfo:
        # A fresh store for every round: restarted workers must not read the keys of the round that failed.
        self.shutdown()
        self._server = StoreServer(self._secret, host=LOOPBACK)
        self._store = JobStore(LOOPBACK, self._server.port, self._secret, self.timeout)  # the agent's own client
        return RendezvousInfo(self._store, 0, 1, RendezvousStoreInfo(LOOPBACK, self._server.port))

    def shutdown(self) -> bool:
        for part in (self._store, self._server):
            if part is not None:
                part.close()
        self._store = self._server = None
        return True
