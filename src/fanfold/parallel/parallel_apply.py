"""parallel_apply: one replica per device, run concurrently by a persistent pool of worker threads (``WorkerPool``),
each with the caller's grad mode, inference mode, autocast and current device; errors name the replica and device.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .._core.devices import DeviceLike, accelerator_type, usable_devices
from .._core.tree import flatten


def _work(tasks: queue.SimpleQueue) -> None:
    while True:
        item = tasks.get()
        if item is None:
            return
        index, fn, threads, done = item
        del item  # hold no reference to a replica or its output while idle
        changed = False
        # get_num_threads first: torch's lazy per-thread initialisation would later overwrite the count set here
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            changed = True
        try:
            done.put((index, True, fn(), changed))
        except BaseException as exc:  # the caller must hear from every worker, whatever happens
            done.put((index, False, exc, changed))
        del fn


def _stop(queues: list) -> None:
    for q in queues:
        q.put(None)


class WorkerPool:
    """Daemon worker threads, one per replica, reused across calls; ``threads_per_worker`` intra-op threads each."""

    def __init__(self, threads_per_worker: int | None = None) -> None:
        if threads_per_worker is not None and (not isinstance(threads_per_worker, int) or threads_per_worker < 1):
            raise ValueError(f"threads_per_worker must be an int >= 1 or None, got {threads_per_worker!r}")
        self.threads_per_worker = threads_per_worker
        self._queues: list[queue.SimpleQueue] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        # the threads hold only their queues, never the pool, so an unreferenced pool is collected and stops them
        self._finalizer = weakref.finalize(self, _stop, self._queues)

    def _grow(self, n: int) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerPool: the pool is closed")
            while len(self._threads) < n:
                q: queue.SimpleQueue = queue.SimpleQueue()
                t = threading.Thread(target=_work, args=(q,), name=f"fanfold-replica-{len(self._threads)}", daemon=True)
                t.start()
                self._queues.append(q)
                self._threads.append(t)

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[tuple[bool, Any]]:
        """Run ``fns[i]`` on worker i, wait for all; ``(True, result)`` or ``(False, exception)`` per fn."""
        self._grow(len(fns))
        caller_threads = torch.get_num_threads()
        threads = self.threads_per_worker or max(1, caller_threads // max(1, len(fns)))
        done: queue.SimpleQueue = queue.SimpleQueue()
        for i, fn in enumerate(fns):
            self._queues[i].put((i, fn, threads, done))
        results: list = [None] * len(fns)
        restore = False
        for _ in fns:
            i, ok, value, changed = done.get()
            results[i] = (ok, value)
            restore |= changed
        if restore:
            torch.set_num_threads(caller_threads)  # the process-wide default a worker's set_num_threads changed
        return results

    def close(self) -> None:
        """Stop the threads (they finish the task at hand); further use raises."""
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _infer_device(module: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for _, leaf in flatten((args, kwargs))[0]:
        if isinstance(leaf, PackedSequence):
            leaf = leaf.data
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _autocast_state(device_type: str) -> tuple | None:
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()
    except RuntimeError:  # a device type autocast does not know
        return None


def _caller_state(devices: list[torch.device], grad: bool | None = None) -> dict:
    """The caller's thread-local state a worker must reproduce; ``grad`` overrides its grad and inference modes."""
    accelerator = accelerator_type()
    return {
        "grad": torch.is_grad_enabled() if grad is None else grad,
        "inference": torch.is_inference_mode_enabled() and grad is None,
        "autocast": {d.type: _autocast_state(d.type) for d in devices},
        "streams": {d: torch.accelerator.current_stream(d) for d in devices if d.type == accelerator},
    }


@contextlib.contextmanager
def in_caller_state(state: dict, device: torch.device) -> Iterator[None]:
    """The current thread in ``state`` (from ``_caller_state``) for work on ``device``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(state["grad"]))
        if state["inference"]:
            stack.enter_context(torch.inference_mode())
        autocast = state["autocast"][device.type]
        if autocast is not None:
            stack.enter_context(torch.autocast(device.type, dtype=autocast[0], cache_enabled=autocast[1]))
        if device in state["streams"]:  # an accelerator: its current device and stream, as in the caller
            stack.enter_context(torch.accelerator.device_index(device.index))
            stack.enter_context(state["streams"][device])
        yield


def _call(module: nn.Module, args: tuple, kwargs: dict, device: torch.device, state: dict) -> Any:
    with in_caller_state(state, device):
        return module(*args, **kwargs)


def reraise(where: str, exc: BaseException) -> None:
    """Raise ``exc`` again, its message starting with ``where`` (e.g. "in replica 1 on device cpu"), as its own type
    where that type takes one message, with the original traceback (the worker's frames, down to the failing line);
    KeyboardInterrupt and the like as they are."""
    if not isinstance(exc, Exception):
        raise exc
    message = f"{where}: {type(exc).__name__}: {exc}"
    try:
        err = type(exc)(message)
    except Exception:
        err = RuntimeError(message)
    raise err.with_traceback(exc.__traceback__) from exc


def _run(pool: WorkerPool, fns: list, devices: list) -> list:
    results = pool.run(fns)
    for i, (ok, value) in enumerate(results):
        if not ok:
            reraise(f"in replica {i} on device {devices[i]}", value)
    return [value for _, value in results]


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike] | None = None,
    *,
    pool: WorkerPool | None = None,
) -> list[Any]:
    """``modules[i](*inputs[i], **kwargs_tup[i])`` on ``devices[i]`` for every i, concurrently; the outputs in order.

    ``inputs[i]`` is a tuple/list of positional arguments or a single argument. ``devices[i]`` defaults to the
    device of the first tensor of replica i's arguments (else of its parameters, else the CPU). One module runs
    inline in the caller's thread. Without ``pool``, a pool is started for this call only.
    """
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(inputs)} inputs; give one input per module")
    if kwargs_tup is None:
        kwargs_tup = [{}] * n
    elif len(kwargs_tup) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(kwargs_tup)} kwargs_tup; give one dict per module")
    if devices is not None and len(devices) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(devices)} devices; give one device per module")
    if n == 0:
        return []
    args = [tuple(x) if isinstance(x, (list, tuple)) else (x,) for x in inputs]
    kwargs = [{} if k is None else k for k in kwargs_tup]
    if devices is None:
        devs = [_infer_device(m, a, k) for m, a, k in zip(modules, args, kwargs)]
    else:
        devs = usable_devices(devices, "devices")
    state = _caller_state(devs)
    if n == 1:
        try:
            return [_call(modules[0], args[0], kwargs[0], devs[0], state)]
        except Exception as exc:
            reraise(f"in replica 0 on device {devs[0]}", exc)

    fns = [
        # default arguments bind this iteration's values (a closure would see the loop's last ones)
        lambda m=m, a=a, k=k, d=d: _call(m, a, k, d, state)
        for m, a, k, d in zip(modules, args, kwargs, devs)
    ]
    if pool is None:
        with WorkerPool() as short_lived:
            return _run(short_lived, fns, devs)
    return _run(pool, fns, devs)
