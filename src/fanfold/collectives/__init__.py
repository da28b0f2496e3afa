"""fanfold.collectives: how ranks talk. The transport interface (``protocol.Transport``), its torch.distributed
implementation (``transport``), the shared-memory transport for ranks on one host (``shm/``), the hierarchical one
for ranks on several hosts (``hierarchical``: shared memory inside each, gloo across), the choice between them
(``select``), the stall inspector every feature talks through (``stall``, ``progress``: numbered, bounded,
diagnosed, profiled collectives), the handle of a collective (``work``), the ``fanfold`` torch.distributed backend
(``backend``), store namespaces (``store``), the wait bound every layer shares (``timeouts``) and the object
collectives, without numpy (``objects``).
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
