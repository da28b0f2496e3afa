"""A reduction the backward cannot finish, against torch's DDP over gloo in the same ranks: parameters no rank used
without find_unused_parameters, and a static graph that changes. torch's DDP finishes that backward with each rank's
own gradients (divided by the world size on their way into the bucket under gradient_as_bucket_view) and raises at
the next forward with grad; fanfold's must do the same, with torch's words, indices and the parameters' names."""
import re

import torch
import torch.distributed as dist

import fanfold
from _conformance import IMPLS, Branchy, data, grads, shard, wrap
from fanfold.distributed import init_process_group, rank, world_size

_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]*)")


def _attempt(fn) -> str | None:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def _step(ddp, r, n, step, use_b):
    x, y = data(step)
    ((ddp(shard(x, r, n), use_b=use_b) - shard(y, r, n)) ** 2).mean().backward()


def _scenarios():
    init_process_group(timeout=60)
    r, n = rank(), world_size()
    out = {}
    for impl in IMPLS:
        for as_view in (False, True):
            for caps in ({}, dict(bucket_cap_mb=0.0002)):  # one bucket; a bucket per layer (out's launches first)
                model = Branchy()  # b and never unused, on every rank
                ddp = wrap(impl, model, gradient_as_bucket_view=as_view, **caps)
                _step(ddp, r, n, 0, use_b=False)
                dist.barrier()  # gloo's barrier waits for torch's unawaited bucket all-reduces
                got = grads(model)
                x = shard(data(1)[0], r, n)
                with torch.no_grad():
                    evaluated = _attempt(lambda: ddp(x))  # no grad: no reduction expected, works
                first = _attempt(lambda: ddp(x))
                again = _attempt(lambda: ddp(x))  # torch's stays broken
                out[impl, as_view, bool(caps)] = got, evaluated, first, again
        for as_view in (False, True):
            # a static graph: b used in the first iteration, unused in the second (then the next forward raises);
            # and unused in the first, used in the second (that backward raises)
            model = Branchy()
            ddp = wrap(impl, model, static_graph=True, gradient_as_bucket_view=as_view)
            _step(ddp, r, n, 0, use_b=True)
            model.zero_grad(set_to_none=True)
            _step(ddp, r, n, 1, use_b=False)
            dist.barrier()
            got = grads(model)
            later = _attempt(lambda: _step(ddp, r, n, 2, use_b=False))
            model = Branchy()
            ddp = wrap(impl, model, static_graph=True, gradient_as_bucket_view=as_view)
            _step(ddp, r, n, 0, use_b=False)
            used_again = _attempt(lambda: _step(ddp, r, n, 1, use_b=True))
            dist.barrier()
            out[impl, as_view, "static"] = got, later, used_again
    return out


def _indices(msg: str) -> tuple[int, set[int]]:
    m = _INDICES.search(msg)
    assert m, msg
    return int(m.group(1)), {int(i) for i in m.group(2).split()}


def test_unfinished_reduction_is_torchs():
    results = fanfold.launch(_scenarios, nprocs=2, timeout=280)
    unused = {"b.weight", "b.bias", "never.weight", "never.bias"}
    for r, res in enumerate(results):
        for as_view in (False, True):
            for tiny in (False, True):
                want, evaluated, first, again = res["torch", as_view, tiny]
                assert evaluated is None and first and again, (as_view, tiny, first)
                assert all(want[k] is None for k in unused)
                for impl in IMPLS[1:]:
                    got, f_eval, f_first, f_again = res[impl, as_view, tiny]
                    where = (impl, as_view, tiny, r)
                    assert got.keys() == want.keys()
                    for k in got:  # the same tensors: this rank's own, or as torch divided them into the bucket
                        assert (got[k] is None) == (want[k] is None) and (
                            got[k] is None or torch.equal(got[k], want[k])), (where, k, got[k], want[k])
                    assert f_eval is None, where
                    for msg in (f_first, f_again):
                        assert msg and "Expected to have finished reduction in the prior iteration" in msg, where
                        assert "passing the keyword argument `find_unused_parameters=True`" in msg
                        assert "`forward` function outputs participate in calculating loss" in msg
                        assert "Since `find_unused_parameters=True` is enabled" not in msg
                        assert _indices(msg) == _indices(first), (msg, first)  # torch's indices
                        names = msg[msg.index("did not receive grad"):]
                        assert all(k in names for k in unused) and "a.weight" not in names and "out." not in names
                        assert f"Parameters which did not receive grad for rank {r}: " in msg
            want, later, used_again = res["torch", as_view, "static"]
            assert "Expected to have finished reduction in the prior iteration" in later
            assert "Your training graph has changed in this iteration" in used_again
            for impl in IMPLS[1:]:
                got, f_later, f_used_again = res[impl, as_view, "static"]
                for k in got:
                    assert (got[k] is None) == (want[k] is None) and (
                        got[k] is None or torch.equal(got[k], want[k])), (impl, as_view, k)
                assert "Expected to have finished reduction in the prior iteration before starting a new one. " \
                       "This error indicates that your training graph has changed in this iteration, e.g., one " \
                       "parameter is used in first iteration, but then got unused in the second iteration. this is " \
                       "not compatible with static_graph set to True.\nParameter indices which did not receive " \
                       "grad for" in f_later, f_later
                assert _indices(f_later) == _indices(later) and "'b.weight' got 0 gradient(s)" in f_later
                assert "Your training graph has changed in this iteration" in f_used_again and "'b." in f_used_again
