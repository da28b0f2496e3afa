"""``eager(fn, *args, **kwargs)``: ``fn(*args, **kwargs)``, which ``torch.compile`` does not trace. Under dynamo's
tracing the call goes through a ``torch.compiler.disable`` function (a graph break: dynamo calls it as Python);
otherwise it is a plain call. That function lives in ``_disabled``, imported the first time dynamo traces an
``eager`` call: decorating with ``torch.compiler.disable`` imports ``torch._dynamo`` (about half the cost of importing
torch), which ``import fanfold`` must not load for the users who never compile."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["eager"]

R = TypeVar("R")


def eager(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)``, run by Python even where dynamo traces the caller."""
    if torch.compiler.is_compiling():
        # dynamo runs this import while tracing (its IMPORT_NAME imports for real); it has loaded torch._dynamo
        from ._disabled import call
        return call(fn, *args, **kwargs)
    return fn(*args, **kwargs)
