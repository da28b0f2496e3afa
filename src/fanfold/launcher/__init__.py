"""Starting worker processes: ``spawn`` runs a function on N local workers (``fanfold.launch``), ``agent`` a script on
torch's elastic agent (``fanfold run``, ``launch_script``), each of whose workers runs ``worker_shim``."""
from .agent import launch_script
from .spawn import WorkerError, free_port, launch

__all__ = ["launch", "WorkerError", "free_port", "launch_script"]
