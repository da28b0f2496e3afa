"""The one ``torch.compiler.disable`` function behind ``eager``: imported only while dynamo traces, since the decorator
imports ``torch._dynamo``."""
from __future__ import annotations

from typing import Any

import torch


@torch.compiler.disable
def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)
