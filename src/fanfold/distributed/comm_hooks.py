"""Communication hooks, torch's ``hook(state, bucket) -> future`` (``wait()`` gives the averaged bucket): the bucket,
a lazily completed future, and the built-in ``allreduce_hook``, ``fp16_compress_hook`` and ``bf16_compress_hook``."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Future", "GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]


class Future:
    """``torch.futures.Future``'s shape, completed lazily by ``wait()``: transports need no callback thread."""

    def __init__(self, wait_fn: Callable[[], Any]):
        self._wait_fn, self._done, self._value = wait_fn, False, None

    def wait(self) -> Any:
        if not self._done:
            self._value = self._wait_fn()
            self._done, self._wait_fn = True, None  # drop the closure: it holds the bucket tensors
        return self._value

    value = wait

    def done(self) -> bool:
        return self._done

    def then(self, callback: Callable[[Future], Any]) -> Future:
        return Future(lambda: (self.wait(), callback(self))[1])


class GradBucket:
    """One bucket as a comm hook sees it (torch's ``GradBucket`` methods, plus ``all_reduce`` and ``divisor``)."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list, grads: list, is_last: bool,
                 divisor: int, issue: Callable[..., Any]):
        self._index, self._buffer, self._params, self._grads = index, buffer, params, grads
        self._is_last, self.divisor, self._issue = is_last, divisor, issue

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list:
        return list(self._params)

    def gradients(self) -> list:
        """Views of the buffer shaped like each parameter (a sparse bucket: the sparse gradient)."""
        return list(self._grads)

    def all_reduce(self, tensor: torch.Tensor, divisor: float | None = None) -> Future:
        """An in-place SUM of ``tensor`` over the ranks, divided by ``divisor`` if given; its value: ``tensor``."""
        handle = self._issue(tensor, self._index, divisor)
        return Future(lambda: (handle.wait(), tensor)[1])


def allreduce_hook(state: Any, bucket: GradBucket) -> Future:
    """Exact fp32 (the bucket's dtype) all-reduce, then divide: the default."""
    return bucket.all_reduce(bucket.buffer(), bucket.divisor)


def _compress(bucket: GradBucket, dtype: torch.dtype) -> Future:
    # float16 overflows at 65504: the sum of N gradients could, so divide first. bfloat16 has float32's range: the
    # all-reduce divides, which saves a pass over the float32 buffer.
    divide_first = dtype == torch.float16
    buffer = bucket.buffer()  # flat, or a sparse gradient's own bucket
    if divide_first and buffer.is_sparse and buffer.device.type == "cpu":
        # torch's hook fails here too: its all-reduce adds float16 sparse tensors, which the CPU cannot
        raise RuntimeError(
            f"fp16_compress_hook: bucket {bucket.index()} holds a sparse gradient, which float16 cannot sum on the "
            "CPU (torch's hook fails alike: \"cadd_sparse\" not implemented for 'Half'); register another hook or "
            "use sparse=False.")
    # in place, then cast: a division straight into the narrow type costs several times as much on CPU
    narrow = (buffer.div_(bucket.divisor) if divide_first else buffer).to(dtype)
    fut = bucket.all_reduce(narrow, None if divide_first else bucket.divisor)
    return fut.then(lambda done: buffer.copy_(done.value()))


def fp16_compress_hook(state: Any, bucket: GradBucket) -> Future:
    """Divide, cast to float16, all-reduce, cast back: half the bytes, ~1e-3 relative error."""
    return _compress(bucket, torch.float16)


def bf16_compress_hook(state: Any, bucket: GradBucket) -> Future:
    """Cast to bfloat16, average, cast back: half the bytes, ~1e-2 relative error."""
    return _compress(bucket, torch.bfloat16)
