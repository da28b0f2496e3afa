"""Why a test's result with fanfold's DDP differs from torch's: found by reading each failure (traceback, test body).

``INTERNAL``: tests that read torch's private DDP internals, with the internals each reads; fanfold would pass them
only by imitating torch's C++ reducer and logger. ``REASONS``: every other difference, with its cause. A difference
missing from both shows as "not investigated yet" in docs/conformance.md. Keep an entry only while its difference
exists: the page lists reasons for the differences of the last run, nothing else.

Layer: data for ``report.py``.
"""
from __future__ import annotations

_LOGGING = ("`model._get_ddp_logging_data()` (the C++ `Logger`'s `DDPLoggingData`){}; everything before the "
            "read ran with fanfold's DDP")
_BUFFER_HOOK = ("`model._register_buffer_comm_hook(state, hook)` (a private hook that replaces the broadcast of "
                "buffers; fanfold has no buffer hook)")
_USED_MAP = ("`model.reducer._get_local_used_map()` (the C++ reducer's per-parameter used bitmap of the last "
             "backward); every step before the read ran with fanfold's DDP")

INTERNAL: dict[str, str] = {
    "test_ddp_broadcast_buffer_via_hook": _BUFFER_HOOK,
    "test_ddp_buffer_hook_allreduce": _BUFFER_HOOK,
    "test_ddp_buffer_hook_allreduce_return_future": _BUFFER_HOOK,
    "test_ddp_bucket_cap_mb_list":
        "`model.bucket_bytes_cap_list` (torch's attribute for the byte caps); the two training steps with "
        "`bucket_cap_mb_list=[1, 2]` before it ran with fanfold's DDP",
    "test_ddp_build_debug_param_to_name_mapping":
        "`model._build_params_for_reducer()` and `model._build_debug_param_to_name_mapping(params)` (how torch "
        "numbers parameters for its C++ reducer's error messages)",
    "test_ddp_build_debug_param_to_name_mapping_requires_grad":
        "`model._build_params_for_reducer()` and `model._build_debug_param_to_name_mapping(params)`, as "
        "`test_ddp_build_debug_param_to_name_mapping`",
    "test_ddp_comm_hook_logging": _LOGGING.format(" for the name of the registered comm hook"),
    "test_ddp_control_flow_different_across_ranks": _USED_MAP,
    "test_ddp_control_flow_same_across_ranks": _USED_MAP,
    "test_ddp_python_error_logged": _LOGGING.format(" for the Python error it raised"),
    "test_ddp_remove_autograd_hooks": "`model._remove_autograd_hooks()` (torch's private hook removal)",
    "test_ddp_sink_noclone":
        "`model._set_ddp_sink_clone(False)` (a switch of torch's `_DDPSink`, the autograd function torch puts "
        "after the forward; fanfold has none)",
    "test_ddp_sync_module_states":
        "`model.broadcast_bucket_size` and `model.parameters_to_ignore`, passed to torch's "
        "`torch.distributed.utils._sync_module_states`",
    "test_ddp_uneven_input_join_disable": "`model._join_config` (torch's `_JoinConfig` record)",
    "test_ddp_uneven_inputs":
        "`model._authoritative_rank` (torch's record of the rank whose model join broadcasts; fanfold fails there "
        "at once, where torch's DDP runs out of time on this CPU)",
    "test_detect_ddp_is_actually_static":
        "`model.reducer._ddp_graph_static()` (the C++ reducer's own verdict on whether the graph was static)",
    "test_different_graph_across_ranks": _LOGGING.format(" for `has_rebuilt_buckets`"),
    "test_skip_all_reduce_unused_parameters": _LOGGING.format(" for `num_buckets_reduced`"),
    "test_sync_bn_logged": _LOGGING.format(" for whether the model has SyncBatchNorm"),
    "test_get_data_parallel_params":
        "`DistributedDataParallel._get_data_parallel_params(module, named_params)` (torch's private generator of "
        "the parameters DDP did not ignore); the ignoring itself (`_set_params_and_buffers_to_ignore_for_model`) "
        "ran with fanfold's class",
    "test_ddp_logging_data_cpu":
        "`model._set_ddp_runtime_logging_sample_rate(2)` and `model._get_ddp_logging_data()` (the C++ `Logger`'s "
        "`DDPLoggingData`: iteration count, bucket sizes and rebuilt bucket indices, environment variables, "
        "compute/communication timings)",
    "test_ddp_unused_params_rebuild_buckets_exception":
        "`verify_ddp_error_logged(ddp, msg)`, i.e. `model._get_ddp_logging_data()` (the error the C++ `Logger` "
        "recorded); before it fanfold raised torch's error at the same moment (the second iteration's forward), "
        "naming `net2.weight`",
    "test_invalid_static_graph":
        "`verify_ddp_error_logged(model, ...)`, i.e. `model._get_ddp_logging_data()` (the error the C++ `Logger` "
        "recorded); before it fanfold raised in the second iteration with the regex's words (\"Your training graph "
        "has changed in this iteration\"), naming `lin2.weight`",
    "test_ddp_native_mixed_precision_ignored_params":
        "`p._mp_param` and `p._fp_param` (torch's low- and full-precision copies of each parameter, set when its "
        "DDP is built); fanfold's DDP was built with `mixed_precision` and `gradient_as_bucket_view=True`",
    "test_ddp_profiling_torch_profiler":
        "the profiler's `search_unused_parameters` event (the record of torch's C++ reducer's private graph search "
        "for unused parameters; fanfold finds them at the end of backward, with no such step). Before it the test "
        "counts `gloo:all_reduce` events, which fanfold's default transport (shared memory) does not make; with "
        "`FANFOLD_TRANSPORT=torch` (gloo underneath) those are there and the test fails only at this read "
        "(`--cuda-on-cpu --only test_ddp_profiling_torch_profiler`, checked)",
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

_OPTIM_SUPERSET = (
    "fanfold's superset: torch's DDP ends the backward of its optimizer-in-backward hook by waiting on the "
    "accelerator's current stream, which the CPU lacks (\"Cannot access accelerator device\"); fanfold's takes the "
    "optimizers over as torch's does (they step on the averaged gradient; docs/ddp-compat.md) and passes.")

REASONS: dict[str, str] = {
    "test_ddp_apply_optim_in_backward": _OPTIM_SUPERSET,
    "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false": _OPTIM_SUPERSET,
    "test_ddp_apply_optim_in_backward_ignored_params": _OPTIM_SUPERSET,
    "test_ddp_inference":
        "fanfold's superset: torch's DDP refuses any SyncBatchNorm in a CPU module when it is built (\"SyncBatchNorm "
        "layers only work with GPU modules\"); fanfold's accepts it, and this test runs its SyncBatchNorm model in "
        "eval mode and under no_grad (running statistics, no collective), so it passes.",
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

_OPTIM_IN_BACKWARD = (
    "torch's DDP: its optimizer-in-backward comm hook ends the backward by waiting on the accelerator's current "
    "stream (\"Cannot access accelerator device\"). fanfold's takes the optimizers over as torch's does (they step "
    "on the averaged gradient; docs/ddp-compat.md) and passes."
)
_MP = ("torch's DDP: its mixed precision waits on a CUDA event (\"cpu backend doesn't support events\"). "
       "fanfold's: {}")

# The CPU port: why a test fails or times out there with torch's DDP, where its error alone does not say (and what
# fanfold's DDP does with it).
PORT_NOTES: dict[str, str] = {
    "test_ddp_apply_optim_in_backward": _OPTIM_IN_BACKWARD,
    "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false": _OPTIM_IN_BACKWARD,
    "test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none": _MP.format(
        "runs (with `gradient_as_bucket_view=True` too), then the test reads `p._mp_param` (torch's low-precision "
        "copy of each parameter)."),
    "test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none": _MP.format(
        "runs (with `gradient_as_bucket_view=True` too), then the test reads `p._mp_param` (torch's low-precision "
        "copy of each parameter)."),
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none": _MP.format(
        "runs (with `gradient_as_bucket_view=True` too), then the test reads `p._mp_param` (torch's low-precision "
        "copy of each parameter)."),
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none": _MP.format(
        "runs, then the test reads `p._mp_param` (torch's low-precision copy of each parameter)."),
    "test_ddp_uneven_inputs":
        "GPU-sized: its `large_conv_model` (three 5x5 convolutions up to 256 channels on a 1000x1000 input, "
        "about 0.2 TFLOP per forward) runs under join for 6 iteration mappings; on shared CPU cores it does not "
        "finish within the bound, with either DDP.",
}
