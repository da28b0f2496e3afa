"""Why a test's result with fanfold's DDP differs from torch's: found by reading each failure (traceback, test body).

``INTERNAL``: tests that read torch's private DDP internals, with the internals each reads; fanfold would pass them
only by imitating torch's C++ reducer and logger. ``REASONS``: every other difference, with its cause. A difference
missing from both shows as "not investigated yet" in docs/conformance.md. Keep an entry only while its difference
exists: the page lists reasons for the differences of the last run, nothing else.

Layer: data for ``report.py``.
"""
from __future__ import annotations

INTERNAL: dict[str, str] = {
    "test_ddp_logging_data_cpu":
        "`model._set_ddp_runtime_logging_sample_rate(2)` and `model._get_ddp_logging_data()` (the C++ `Logger`'s "
        "`DDPLoggingData`: iteration count, bucket sizes and rebuilt bucket indices, environment variables, "
        "compute/communication timings)",
    "test_static_graph_api_cpu":
        "`model._set_static_graph()` (the private pre-2.0 way to ask for a static graph; must raise \"should be "
        "called before training loop starts\" after a step) and `model._get_ddp_logging_data()` (the error logged "
        "by the C++ `Logger`)",
}

_PICKLE = (
    "fanfold bug: a DDP model cannot be pickled. The test saves the whole wrapped model with `torch.save(model_DDP)` "
    "and compares the reloaded state dict; fanfold's `DistributedDataParallel` keeps live objects in its attributes "
    "and defines no `__getstate__`/`__setstate__` (torch's drops the process group and the reducer and rebuilds them "
    "on load): `transport` and `reducer.transport` (the stall inspector's `threading.Condition` and `PrefixStore`; "
    "with the shared-memory transport also its worker thread, lock, request queue, `mmap` segment and futex "
    "function) and `reducer._handles` (the autograd hook handles). With the shm transport pickling stops at "
    "\"cannot pickle '_thread.lock'\", with `FANFOLD_TRANSPORT=torch` at \"cannot pickle "
    "'torch._C._distributed_c10d.PrefixStore'\". `copy.deepcopy` fails the same way."
)

REASONS: dict[str, str] = {
    "test_DistributedDataParallelCPU": _PICKLE,
    "test_DistributedDataParallelCPU_grad_is_view":
        "as `test_DistributedDataParallelCPU` (the same test with `gradient_as_bucket_view=True`): a DDP model "
        "cannot be pickled.",
    "test_DistributedDataParallel_requires_grad":
        "fanfold bug: `DistributedDataParallel(nn.Module())` (no parameter that requires a gradient) is accepted; "
        "torch raises RuntimeError (\"DistributedDataParallel is not needed when a module doesn't have any "
        "parameter that requires a gradient\"), and the test expects that RuntimeError.",
    "test_ddp_create_graph":
        "fanfold bug, in the shared-memory transport only: `loss.backward(create_graph=True)` makes the gradients "
        "require grad, and the shm engine sums them with `torch.add(a, b, out=...)` (`shm_engine._sum`), which "
        "autograd refuses (\"add(): functions with out=... arguments don't support automatic differentiation\"). "
        "The error is raised in rank 0's shm worker thread; rank 1 then fails its wait of the same all-reduce with "
        "`ShmTimeoutError` naming rank 0's error (both ranks end with `StallError` within seconds here: no hang "
        "with `FANFOLD_STALL_TIMEOUT=60`). With `FANFOLD_TRANSPORT=torch` the test passes: the reduction must "
        "detach the gradients (as torch's reducer does) before summing them in place.",
}

# The CPU port (``driver.py --cuda-on-cpu``): tests whose subject is CUDA itself, not run there, one reason each.
CUDA_ONLY: dict[str, str] = {
    "test_DistributedDataParallel_non_default_stream":
        "CUDA streams: the backward runs on a non-default CUDA stream and the test checks that DDP's all-reduce "
        "waits for it (also skipped by torch on Linux).",
    "test_DistributedDataParallel_with_amp_and_grad_is_view":
        "AMP on the GPU: `torch.cuda.amp.autocast` and `GradScaler`; on the CPU the scaler disables itself and "
        "autocast(\"cuda\") does nothing, so the test would pass as a plain float32 run and show nothing.",
    "test_ddp_device":
        "CUDA placement: checks that DDP moved every input (tensors in tuples, lists, dicts, custom types) to "
        "the CUDA device of `device_ids` (`x.device.index == rank`); with every device the CPU there is no move.",
    "test_ddp_logging_data_gpu":
        "the C++ `Logger`'s record of the CUDA devices (`device_ids`, `output_device`) and of GPU timings, read "
        "through `model._get_ddp_logging_data()`; the CPU half of the same test is `test_ddp_logging_data_cpu`.",
}

# The CPU port: why torch's own DDP fails or times out there, where its error alone does not say.
PORT_NOTES: dict[str, str] = {
    "test_ddp_uneven_inputs":
        "GPU-sized: its `large_conv_model` (three 5x5 convolutions up to 256 channels on a 1000x1000 input, "
        "about 0.2 TFLOP per forward) runs under join for 6 iteration mappings; on shared CPU cores it does not "
        "finish within the bound, with either DDP.",
}
