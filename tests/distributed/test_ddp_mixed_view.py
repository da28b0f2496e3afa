"""``mixed_precision`` with ``gradient_as_bucket_view=True``, against torch's DDP over gloo in the same ranks.

torch's mixed precision orders its casts with CUDA streams and events, which the CPU refuses ("cpu backend doesn't
support events"); on the CPU every operation runs in issue order, so here torch's ``Event`` and the accelerator's
current stream are no-ops and torch's own DDP code runs unchanged otherwise. Its semantics: the buckets hold the
low precision, and after each backward ``.grad`` is the full-precision average (a copy, not a bucket view)."""
import functools
from unittest import mock

import pytest
import torch
from torch import nn

import fanfold
from _conformance import Mixed, data, grads, shard
from fanfold.distributed import init_process_group, rank, world_size


class _NoEvent:
    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


class _NoStream:
    def wait_stream(self, stream):
        pass


def _train(set_to_none, param_dtype, reduce_dtype):
    from torch.nn.parallel.distributed import _MixedPrecision

    init_process_group(timeout=60)
    r, n = rank(), world_size()
    out = {}
    for impl, as_view in (("torch", True), ("torch", False), ("fanfold", True), ("fanfold", False)):
        model = Mixed()
        cfg = _MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=param_dtype)
        cls = nn.parallel.DistributedDataParallel if impl == "torch" else fanfold.DDP
        with mock.patch("torch.Event", _NoEvent), \
                mock.patch("torch.accelerator.current_stream", lambda *args: _NoStream()):
            ddp = cls(model, mixed_precision=cfg, gradient_as_bucket_view=as_view)
            steps = []
            for step in range(3):
                x, y = data(step)
                ((ddp(shard(x, r, n)).float() - shard(y, r, n)) ** 2).mean().backward()
                steps.append((grads(model), [p.dtype for p in model.parameters()], ddp.gradient_as_bucket_view))
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-0.1)
                model.zero_grad(set_to_none=set_to_none)
        out[impl, as_view] = steps
    return out


@pytest.mark.parametrize("set_to_none, param_dtype, reduce_dtype", [
    (False, torch.float16, None), (True, torch.float16, torch.float16), (True, torch.bfloat16, torch.float32)])
def test_mixed_precision_with_bucket_views_is_torchs(set_to_none, param_dtype, reduce_dtype):
    results = fanfold.launch(functools.partial(_train, set_to_none, param_dtype, reduce_dtype), nprocs=2, timeout=240)
    tol = dict(atol=2e-3, rtol=1e-2) if param_dtype == torch.float16 else dict(atol=2e-2, rtol=5e-2)
    for r, res in enumerate(results):
        for as_view in (True, False):
            # torch's own run with bucket views is accepted but its gradients are not usable on the CPU (zeros and
            # infinities, different from run to run: it frees the low-precision storage the views read); its run
            # without them is the oracle, which torch documents for both
            for step, ((want, w_dtypes, _), (got, g_dtypes, flag)) in enumerate(
                    zip(res["torch", False], res["fanfold", as_view], strict=True)):
                assert flag is as_view and g_dtypes == w_dtypes == [torch.float32] * 5, (step, g_dtypes)
                for k in want:
                    assert got[k].dtype == want[k].dtype == torch.float32, k
                    assert torch.allclose(got[k], want[k], **tol), (r, as_view, step, k, got[k], want[k])
    for (g0, _, _), (g1, _, _) in zip(results[0]["fanfold", True], results[1]["fanfold", True]):
        assert all(torch.equal(g0[k], g1[k]) for k in g0)  # averaged: the same on every rank
