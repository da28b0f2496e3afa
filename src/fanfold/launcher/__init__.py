"""fanfold.launcher: starting worker processes. ``spawn`` runs a Python function on N local workers
(``fanfold.launch``); ``agent`` runs a script on torch's elastic agent (``fanfold run``, ``launch_script``);
``worker_shim`` is what each of those workers executes. May import ``fanfold._core`` only.
"""
from .agent import launch_script
from .spawn import WorkerError, free_port, launch

__all__ = ["launch", "WorkerError", "free_port", "launch_script"]
