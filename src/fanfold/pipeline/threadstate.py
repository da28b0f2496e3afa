"""The caller's thread-local torch state (grad mode, inference mode, autocast, an accelerator's current device),
carried into the threads that run the stages: a fresh thread would otherwise build a graph under the caller's
``torch.no_grad()`` or run in float32 under its ``autocast``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

# (dtype, cache) of a device type where autocast is on: the state DataParallel carries into its workers too
from ..parallel.parallel_apply import _autocast_state

__all__ = ["ThreadState", "capture"]


@dataclass(frozen=True)
class ThreadState:
    grad: bool
    inference: bool
    # per device type: (dtype, cache enabled) when autocast is on for it
    autocast: dict[str, tuple[torch.dtype, bool]] = field(default_factory=dict)

    @contextlib.contextmanager
    def applied(self, device: torch.device) -> Iterator[None]:
        """This state in the current thread, with ``device`` current if it is an accelerator."""
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            cast = self.autocast.get(device.type)
            if cast is not None:
                stack.enter_context(torch.autocast(device.type, dtype=cast[0], cache_enabled=cast[1]))
            if device.type != "cpu" and device.index is not None:
                stack.enter_context(torch.accelerator.device_index(device.index))
            yield


def capture(devices: Sequence[torch.device], grad: bool | None = None) -> ThreadState:
    """The calling thread's state for stages on ``devices``; ``grad`` overrides its grad mode."""
    casts = {d.type: _autocast_state(d.type) for d in devices}
    return ThreadState(
        grad=torch.is_grad_enabled() if grad is None else grad,
        inference=torch.is_inference_mode_enabled() and grad is None,
        autocast={k: v for k, v in casts.items() if v is not None},
    )
