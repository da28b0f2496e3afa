"""fanfold.collectives: how ranks talk. The transport interface and its one handle (``protocol``), its
implementations (torch's ``transport``, ``shm/`` on one host, ``hierarchical`` across hosts, chosen by ``select``),
the stall inspector every feature talks through (``stall``) and the ``fanfold`` torch.distributed backend.
"""
from .backend import FanfoldProcessGroup
from .hierarchical import HierarchicalTransport
from .protocol import Transport, TransportOwner, Work
from .select import resolve_transport, select_transport
from .shm.segment import ShmTimeoutError
from .shm.transport import ShmTransport
from .transport import TorchTransport

__all__ = ["FanfoldProcessGroup", "Transport", "TransportOwner", "Work", "TorchTransport", "ShmTransport",
           "HierarchicalTransport", "ShmTimeoutError", "select_transport", "resolve_transport"]
