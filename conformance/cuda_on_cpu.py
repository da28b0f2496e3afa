"""The suite's CUDA devices mapped to the CPU inside one rank process: ``driver.py --cuda-on-cpu``.

torch's DDP tests that need GPUs skip on a CPU machine, yet most of them test DDP, not CUDA. :func:`install`, run in
a rank process before its test, makes them run on the CPU without editing torch's files:

- the suite sees a node of 8 CUDA devices (more if the world is larger; the hierarchical SGD tests ask for 4 even
  with 2 ranks): ``distributed_test`` and ``common_distributed`` (whose decorators decide the skips) get, as their
  global ``torch``, a stand-in whose ``cuda`` answers ``is_available()`` with True, ``device_count()`` with 8, and
  makes ``set_device``, ``synchronize`` and ``device(i)`` do nothing;
  ``common_distributed.TEST_CUDA`` is True. torch itself is left honest: only the suite's code sees the stand-in.
- every tensor the test puts on a CUDA device stays on the CPU: a torch function mode rewrites a ``device=`` naming
  CUDA (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 1)`` or an index) to ``"cpu"``, and so does
  ``Tensor.to``/``Tensor.cuda``; ``nn.Module.to`` too (it parses an index before any tensor sees it).
- DDP (torch's or fanfold's, whichever the run uses) drops ``device_ids`` and ``output_device``: torch's refuses
  them for a CPU module.

A test whose subject is CUDA itself (streams, AMP, device placement checks) is not run: ``reasons.CUDA_ONLY``.
Layer: a tool beside the package, used by ``driver.py``; imports no fanfold.
"""
from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.testing._internal import common_distributed
from torch.testing._internal.distributed import distributed_test

__all__ = ["install", "host_device"]

CPU = torch.device("cpu")
DEVICES = 8  # the suite's CUDA devices per node: torch's multi-GPU CI machines have 4 or 8


def host_device(device: Any) -> Any:
    """``device`` with a CUDA device (name, ``torch.device`` or index) replaced by the CPU; anything else as is."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    return device


class _CudaToCpu(TorchFunctionMode):
    """Every CUDA placement a torch function is asked for becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = host_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            # the tensor is already where the test's "GPU" is: as .cuda() on a CUDA tensor, itself
            return args[0]
        if func is torch.Tensor.to:
            args = (args[0], *(a if isinstance(a, (torch.dtype, torch.Tensor)) else host_device(a) for a in args[1:]))
        return func(*args, **kwargs)


class _SuiteCuda(types.ModuleType):
    """``torch.cuda`` as the suite sees it: ``count`` devices, all of them the CPU."""

    def __init__(self, count: int) -> None:
        super().__init__("torch.cuda")
        self._count, self._current = count, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._count

    def set_device(self, device: Any) -> None:
        self._current = (device.index or 0) if isinstance(device, torch.device) else int(device)

    def current_device(self) -> int:
        return self._current

    def synchronize(self, device: Any = None) -> None:
        pass

    def device(self, device: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _SuiteTorch(types.ModuleType):
    """``torch`` with ``cuda`` replaced; every other name is torch's own."""

    def __init__(self, cuda: _SuiteCuda) -> None:
        super().__init__("torch")
        self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _module_to(real):
    @functools.wraps(real)
    def to(self, *args, **kwargs):
        args = tuple(a if isinstance(a, (torch.dtype, torch.Tensor)) else host_device(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = host_device(kwargs["device"])
        return real(self, *args, **kwargs)
    return to


def _without_devices(real):
    @functools.wraps(real)
    def __init__(self, module, *args, **kwargs):
        # device_ids and output_device are DDP's 2nd and 3rd parameters (torch's and fanfold's signatures)
        args = tuple(None if i < 2 else a for i, a in enumerate(args))
        kwargs.update({k: None for k in ("device_ids", "output_device") if k in kwargs})
        real(self, module, *args, **kwargs)
    return __init__


def install(ddp_class: type, world_size: int) -> None:
    """Map the suite's CUDA devices to the CPU in this (rank) process, for the rest of its life."""
    suite_torch = _SuiteTorch(_SuiteCuda(max(DEVICES, world_size)))
    for module in (distributed_test, common_distributed):
        module.torch = suite_torch
    common_distributed.TEST_CUDA = True
    torch.nn.Module.to = _module_to(torch.nn.Module.to)
    ddp_class.__init__ = _without_devices(ddp_class.__init__)
    # entered and never left: the rank process ends with its test (the mode stack is per thread; DDP's and the
    # test's placements are all made in the rank's main thread)
    _CudaToCpu().__enter__()
