"""Model keys across wrappers: unwrap DataParallel / DDP / ``torch.compile`` and reconcile their key prefixes.

``checkpoint`` saves the unwrapped model's keys and, on load, matches saved and live keys after removing what
wrappers add on either side: a ``module.``, ``_orig_mod.`` or ``_forward_module.`` prefix shared by every key
(repeatedly, e.g. ``module._orig_mod.``), and ``_orig_mod`` anywhere (a compiled submodule). Knows wrappers only by
duck typing, so it sits above every layer without importing DataParallel or DDP.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ._safe_file import CheckpointError

__all__ = ["unwrap_module", "unwrap_state_dict", "drop_orig_mod", "match_keys"]

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


def _strip(keys: list[str]) -> list[str]:
    # A whole-model wrapper prefixes every key; a compiled submodule adds `_orig_mod` inside the tree.
    while keys:
        prefix = next((p for p in _PREFIXES if all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        keys = [k[len(prefix):] for k in keys]
    return drop_orig_mod(keys)


def unwrap_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with wrapper prefixes removed (``module.``, ``_orig_mod.``, ``_forward_module.``, nested)."""
    keys = list(state_dict)
    stripped = _strip(keys)
    if len(set(stripped)) != len(stripped):
        raise CheckpointError(f"state dict keys collide once wrapper prefixes are removed: {keys[:10]}")
    return OrderedDict(zip(stripped, state_dict.values()))


def match_keys(path: Path, name: str, saved: Any, live: Mapping[str, Any], strict: bool) -> dict:
    """``saved`` renamed to the live module's keys; CheckpointError listing missing / unexpected / shape misfits."""
    if not (isinstance(saved, Mapping) and all(isinstance(k, str) for k in saved)):
        raise CheckpointError(f"{path}: entry {name!r} is a {type(saved).__name__}, not a module state dict")
    saved_keys = dict(zip(_strip(list(saved)), saved))
    live_keys = dict(zip(_strip(list(live)), live))
    if len(saved_keys) != len(saved) or len(live_keys) != len(live):
        raise CheckpointError(f"{path}: entry {name!r}: keys collide once wrapper prefixes are removed")
    missing = [live_keys[k] for k in live_keys if k not in saved_keys]
    unexpected = [saved_keys[k] for k in saved_keys if k not in live_keys]
    shapes = [f"{live_keys[k]}: saved {tuple(saved[saved_keys[k]].shape)}, model {tuple(live[live_keys[k]].shape)}"
              for k in live_keys if k in saved_keys and isinstance(live[live_keys[k]], torch.Tensor)
              and isinstance(saved[saved_keys[k]], torch.Tensor)
              and saved[saved_keys[k]].shape != live[live_keys[k]].shape]
    if shapes or (strict and (missing or unexpected)):
        parts = [f"{label} ({len(keys)}): {keys[:20]}{' ...' if len(keys) > 20 else ''}"
                 for label, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                     ("shape mismatches", shapes)) if keys]
        raise CheckpointError(f"{path}: entry {name!r} does not fit the model: " + "; ".join(parts))
    return OrderedDict((live_keys[k], saved[saved_keys[k]]) for k in live_keys if k in saved_keys)
