"""Wrapper prefixes, written once: unwrap DataParallel / DDP / ``torch.compile`` and strip the key prefixes they add.

Wrappers add, on either side of a checkpoint: a ``module.``, ``_orig_mod.`` or ``_forward_module.`` prefix shared by
every key (repeatedly, e.g. ``module._orig_mod.``), and ``_orig_mod`` anywhere (a compiled submodule). Knows wrappers
only by duck typing, so this bottom layer imports neither DataParallel nor DDP; ``training.checkpoint`` matches saved
and live keys with it.
"""
from __future__ import annotations

from torch import nn

__all__ = ["unwrap_module", "drop_orig_mod", "strip_prefixes"]

_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")


def unwrap_module(module: nn.Module) -> nn.Module:
    """The user's model inside DataParallel / DDP (fanfold's or torch's) and ``torch.compile`` wrappers."""
    while True:
        inner = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            inner = module._modules.get("module")  # not getattr: DataParallel's attribute fall-through
            wrapper = isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or \
                type(module).__module__.startswith("fanfold.")
            if not (wrapper and isinstance(inner, nn.Module)):
                return module
        module = inner


def drop_orig_mod(keys: list[str]) -> list[str]:
    return [".".join(part for part in k.split(".") if part != "_orig_mod") for k in keys]


def strip_prefixes(keys: list[str]) -> list[str]:
    # A whole-model wrapper prefixes every key; a compiled submodule adds `_orig_mod` inside the tree.
    while keys:
        prefix = next((p for p in _PREFIXES if all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        keys = [k[len(prefix):] for k in keys]
    return drop_orig_mod(keys)
