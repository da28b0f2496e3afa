"""Devices, written once: an index, a string or a ``torch.device`` becomes a ``torch.device`` that compares equal
across spellings ("cpu:0" and "cpu"; "cuda" and "cuda:<current>"); ``usable_device(s)`` also check that the device
exists here, with a ValueError naming the argument. The accelerator type comes from ``torch.accelerator``."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Union

import torch

DeviceLike = Union[int, str, torch.device]  # noqa: UP007 (an alias evaluated at run time on Python 3.10)


def accelerator_type() -> str | None:
    acc = torch.accelerator.current_accelerator(check_available=True)
    return None if acc is None else acc.type


def normalize_device(device: DeviceLike) -> torch.device:
    """``device`` with a canonical index: an int ``i`` is index ``i`` of the current accelerator (``cuda:i`` without
    one, as torch does); an accelerator device without an index gets the current one; the CPU has no index."""
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"a device must be an int, a str or a torch.device, got {type(device).__name__}: {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"a device index must be >= 0, got {device}")
        return torch.device(accelerator_type() or "cuda", device)
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"not a device: {device!r} ({e})") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.index is None and dev.type == accelerator_type():
        return torch.device(dev.type, torch.accelerator.current_device_index())
    return dev


def default_device_ids() -> list[int]:
    if accelerator_type() is None:
        return []
    return list(range(torch.accelerator.device_count()))


def usable_device(device: DeviceLike, name: str, cpu_spelling: str = "") -> torch.device:
    """``normalize_device(device)``, refused with a ValueError naming ``name`` unless this machine has it."""
    try:
        dev = normalize_device(device)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
    if dev.type in ("cpu", "meta"):
        return dev
    acc = accelerator_type()
    if dev.type != acc:
        spelling = cpu_spelling or f"for the CPU give {name}='cpu'"
        raise ValueError(f"{name} is {dev}, but this machine has no {dev.type} device; {spelling}")
    count = torch.accelerator.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{name} is {dev}, but this machine has {count} {acc} device{'s' * (count != 1)} "
                         f"({acc}:0 to {acc}:{count - 1})")
    return dev


def usable_devices(devices: Iterable[DeviceLike], name: str = "device_ids") -> list[torch.device]:
    """Every device of ``devices`` normalised, refused with an error naming ``name[i]`` unless this machine has it."""
    if isinstance(devices, (int, str, torch.device)):
        raise TypeError(f"{name} must be a list of devices, got a single device {devices!r}")
    devices = list(devices)
    if not devices:
        raise ValueError(f"{name} is empty: give at least one device (e.g. [0] or ['cpu'])")
    cpus = f"for CPU replicas give {name}=['cpu'] * {len(devices)}"
    return [usable_device(d, f"{name}[{i}]", cpus) for i, d in enumerate(devices)]
