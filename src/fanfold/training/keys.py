"""Checkpoint keys across wrappers: a saved state dict renamed to the live module's keys, or a CheckpointError that
lists what does not fit. Wrappers add a ``module.``, ``_orig_mod.`` or ``_forward_module.`` prefix to every key
(repeatedly, e.g. ``module._orig_mod.``), and a compiled submodule ``_orig_mod`` anywhere.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .safe_file import CheckpointError

__all__ = ["unwrap_state_dict", "match_keys", "drop_orig_mod"]

_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")


def drop_orig_mod(keys: list[str]) -> list[str]:
    return [".".join(part for part in k.split(".") if part != "_orig_mod") for k in keys]


def _strip_prefixes(keys: list[str]) -> list[str]:
    while keys:
        prefix = next((p for p in _PREFIXES if all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        keys = [k[len(prefix):] for k in keys]
    return drop_orig_mod(keys)


def unwrap_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with wrapper prefixes removed (``module.``, ``_orig_mod.``, ``_forward_module.``, nested)."""
    keys = list(state_dict)
    stripped = _strip_prefixes(keys)
    if len(set(stripped)) != len(stripped):
        raise CheckpointError(f"state dict keys collide once wrapper prefixes are removed: {keys[:10]}")
    return OrderedDict(zip(stripped, state_dict.values()))


def match_keys(path: Path, name: str, saved: Any, live: Mapping[str, Any], strict: bool) -> dict:
    """``saved`` renamed to the live module's keys; CheckpointError listing missing / unexpected / shape misfits."""
    if not (isinstance(saved, Mapping) and all(isinstance(k, str) for k in saved)):
        raise CheckpointError(f"{path}: entry {name!r} is a {type(saved).__name__}, not a module state dict")
    saved_keys = dict(zip(_strip_prefixes(list(saved)), saved))
    live_keys = dict(zip(_strip_prefixes(list(live)), live))
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
