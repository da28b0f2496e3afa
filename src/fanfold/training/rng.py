"""Capture and restore one process's random number generators as plain containers and tensors.

Used by ``checkpoint`` so that a resumed run draws the same random numbers as an uninterrupted one: torch's CPU
generator, CUDA's (when CUDA is already initialised), numpy's legacy global generator (when numpy is imported) and
Python's ``random``. The captured state holds only what ``torch.load(weights_only=True)`` accepts, so a checkpoint
carrying it never needs the unpickler to build arbitrary objects.
"""
from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """This process's generator states: keys ``torch``, ``python``, and ``cuda`` / ``numpy`` when in use."""
    version, words, gauss_next = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(words), gauss_next]}
    # Only touch CUDA if the program already did: initialising it here would create a context on every device.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    numpy = sys.modules.get("numpy")  # a program that never imported numpy cannot depend on its generator
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = [str(name), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` captured; generators it did not capture are left as they are."""
    torch.set_rng_state(state["torch"])
    version, words, gauss_next = state["python"]
    random.setstate((version, tuple(words), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        # A machine with fewer devices restores the devices it has; the others' states have nowhere to go.
        for index, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, index)
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype(numpy.uint32), pos, has_gauss, cached))
