"""Every calling form of torch's ``ProcessGroup`` methods, on the ``fanfold`` backend's group, against gloo's group
called the same way (2 ranks): ``allreduce(tensor)`` (torch's DDP join hook calls it), ``allreduce(tensors, op)``,
``broadcast(tensor, root)``, ``allgather(outputs, input)``, ``reduce_scatter(output, inputs, op)``, the keyword
forms, ``barrier(timeout=...)``..., and torch's functional collectives. A rank alone times out after the shorter of
the group's timeout and ``$FANFOLD_STALL_TIMEOUT``, naming the missing rank. (A Work dropped by Python while torch's
C++ holds it: ``tests/distributed/test_ddp_join_hooks.py``, torch's DDP under join.)"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fanfold

SUM, MAX, MIN, PRODUCT = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT
LONG = timedelta(seconds=30)


def _cases(r, n):
    """(name, method, build): ``build()`` makes fresh tensors and returns the call's args, kwargs and the tensors
    it writes."""
    from torch._C._distributed_c10d import AllgatherOptions

    def x(seed, shape=(5,), dtype=torch.float64):
        t = torch.randn(shape, generator=torch.Generator().manual_seed(100 * seed + r), dtype=torch.float64)
        return t if dtype.is_floating_point else (t * 10).round().to(dtype)

    def empty(*shape):
        return torch.empty(shape, dtype=torch.float64)

    def opts(kind, **fields):
        made = kind()
        for name, value in fields.items():
            setattr(made, name, value)
        return made

    def call(*args, written, **kwargs):
        return args, kwargs, written

    return [
        ("allreduce(tensors, opts)", "allreduce",
         lambda: call([t := x(0)], opts(dist.AllreduceOptions, reduceOp=MAX), written=[t])),
        ("allreduce(tensors)", "allreduce", lambda: call([t := x(1)], written=[t])),
        ("allreduce(tensors, op)", "allreduce", lambda: call([t := x(2)], MAX, written=[t])),
        ("allreduce(tensors, op=, timeout=)", "allreduce",
         lambda: call([t := x(3)], op=MIN, timeout=LONG, written=[t])),
        ("allreduce(tensor)", "allreduce", lambda: call(t := x(4), written=[t])),
        ("allreduce(tensor), int32", "allreduce", lambda: call(t := x(5, dtype=torch.int32), written=[t])),
        ("allreduce(tensor, op)", "allreduce", lambda: call(t := x(6), PRODUCT, written=[t])),
        ("allreduce(tensor=, op=)", "allreduce", lambda: call(tensor=(t := x(7)), op=MAX, written=[t])),
        ("allreduce(tensor), 70000 elements", "allreduce", lambda: call(t := x(8, (70000,)), written=[t])),
        ("allreduce_coalesced(tensors)", "allreduce_coalesced",
         lambda: call([a := x(9), b := x(10, (3, 2))], written=[a, b])),
        ("broadcast(tensors)", "broadcast", lambda: call([t := x(11)], written=[t])),
        ("broadcast(tensors, opts)", "broadcast",
         lambda: call([t := x(12)], opts(dist.BroadcastOptions, rootRank=1), written=[t])),
        ("broadcast(tensor, root)", "broadcast", lambda: call(t := x(13), 1, written=[t])),
        ("broadcast(tensor=, root=, timeout=)", "broadcast",
         lambda: call(tensor=(t := x(14)), root=1, timeout=LONG, written=[t])),
        ("allgather(lists, tensors, opts)", "allgather",
         lambda: call([o := [empty(5) for _ in range(n)]], [x(15)], AllgatherOptions(), written=o)),
        ("allgather(outputs, tensor)", "allgather", lambda: call(o := [empty(5) for _ in range(n)], x(16), written=o)),
        ("allgather(output_tensors=, input_tensor=, timeout=)", "allgather",
         lambda: call(output_tensors=(o := [empty(5) for _ in range(n)]), input_tensor=x(17), timeout=LONG, written=o)),
        ("all_gather_single(output, input)", "all_gather_single", lambda: call(o := empty(5 * n), x(18), written=[o])),
        ("_allgather_base(output=, input=)", "_allgather_base",
         lambda: call(output=(o := empty(5 * n)), input=x(19), written=[o])),
        ("reduce_scatter(outputs, lists)", "reduce_scatter",
         lambda: call([o := empty(5)], [[x(20 + k) for k in range(n)]], written=[o])),
        ("reduce_scatter(output, inputs, op)", "reduce_scatter",
         lambda: call(o := empty(5), [x(24 + k) for k in range(n)], MAX, written=[o])),
        ("reduce_scatter(output=, input=, op=, timeout=)", "reduce_scatter",
         lambda: call(output=(o := empty(5)), input=[x(28 + k) for k in range(n)], op=MIN, timeout=LONG, written=[o])),
        ("reduce_scatter_single(outputTensor=, inputTensor=)", "reduce_scatter_single",
         lambda: call(outputTensor=(o := empty(3)), inputTensor=x(32, (3 * n,)), written=[o])),
        ("_reduce_scatter_base(output, input, opts)", "_reduce_scatter_base",
         lambda: call(o := empty(3), x(33, (3 * n,)), opts(dist.ReduceScatterOptions, reduceOp=MAX), written=[o])),
        ("all_to_all_single(output, input, [], [])", "all_to_all_single",
         lambda: call(o := empty(2 * n), x(34, (2 * n,)), [], [], written=[o])),
        ("all_to_all_single(output, input, splits, splits, timeout=)", "all_to_all_single",
         lambda: call(o := empty(2 * n), x(35, (2 * n,)), [2] * n, [2] * n, timeout=LONG, written=[o])),
        ("alltoall_base(output, input, [], [])", "alltoall_base",
         lambda: call(o := empty(2 * n), x(36, (2 * n,)), [], [], written=[o])),
        ("barrier()", "barrier", lambda: call(written=[])),
        ("barrier(opts=)", "barrier", lambda: call(opts=dist.BarrierOptions(), written=[])),
        ("barrier(timeout=)", "barrier", lambda: call(timeout=LONG, written=[])),
    ]


def _forms():
    dist.init_process_group("fanfold", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    fan, gloo = dist.group.WORLD, dist.new_group(backend="gloo")
    out = {"shm": None, "results": {}}
    for name, method, build in _cases(r, n):
        got = {}
        for label, group in (("gloo", gloo), ("fanfold", fan)):
            args, kwargs, written = build()
            try:
                work = getattr(group, method)(*args, **kwargs)
                got[label] = (work.wait(), [t.clone() for t in written])
            except Exception as exc:  # noqa: BLE001 - the test compares what each backend did
                got[label] = (f"{type(exc).__name__}: {exc}", None)
        out["results"][name] = got
    # an async collective completed at return (the latency path) says so, as gloo's do once done
    out["completed"] = dist.all_reduce(torch.ones(2), async_op=True).is_completed()
    # torch's functional collectives reach the group from C++ (torch.ops._c10d_functional), and through the
    # group's transport (DTensor's full_tensor() and FSDP2 call them)
    import torch.distributed._functional_collectives as funcol
    x = torch.randn(6, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
    out["transport"] = {}
    for name, fn in (("funcol.all_reduce", lambda g: [funcol.all_reduce(x, "sum", g)]),
                     ("funcol.all_gather_single", lambda g: [funcol.all_gather_single(x, 0, g)]),
                     ("funcol.reduce_scatter_single", lambda g: [funcol.reduce_scatter_single(x, "sum", 0, g)]),
                     ("funcol.all_gather_single_coalesced",
                      lambda g: funcol.all_gather_single_coalesced([x, 2 * x], g)),
                     ("funcol.reduce_scatter_single_coalesced",
                      lambda g: funcol.reduce_scatter_single_coalesced([x, 2 * x], "sum", [0, 0], g))):
        out["results"][name] = {}
        for label, group in (("gloo", gloo), ("fanfold", fan)):
            before = fan.transport.issued
            out["results"][name][label] = (True, [funcol.wait_tensor(t).clone() for t in fn(group)])
            if label == "fanfold":
                out["transport"][name] = fan.transport.issued - before
    out["shm"] = fan.transport is not None
    dist.destroy_process_group()
    return out


def test_every_calling_form_gives_gloos_result():
    out = fanfold.launch(_forms, nprocs=2, timeout=120)
    for o in out:
        assert o["shm"] and o["completed"]
        # one collective of the transport a tensor (the latency path counts too)
        assert o["transport"] == {"funcol.all_reduce": 1, "funcol.all_gather_single": 1,
                                  "funcol.reduce_scatter_single": 1, "funcol.all_gather_single_coalesced": 2,
                                  "funcol.reduce_scatter_single_coalesced": 2}, o["transport"]
        for name, got in o["results"].items():
            assert got["gloo"][0] is True, (name, got["gloo"])  # the form is one torch accepts
            assert got["fanfold"][0] is True, (name, got["fanfold"][0])
            assert all(torch.equal(a, b) for a, b in zip(got["fanfold"][1], got["gloo"][1], strict=True)), name


def _alone_with_stall_timeout():
    dist.init_process_group("fanfold", timeout=timedelta(seconds=60))
    r, out = dist.get_rank(), {}
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=100))
    dist.all_reduce(torch.ones(2))  # the shared memory is set up
    if r == 0:  # rank 1 skips these, alive: it waits in gloo's barrier below
        for name, async_op in (("sync", False), ("async", True)):
            start = time.monotonic()
            try:
                work = dist.all_reduce(torch.ones(70000), async_op=async_op)
                if work is not None:
                    work.wait()
                out[name] = (None, time.monotonic() - start)
            except Exception as exc:  # noqa: BLE001 - the test reads the message
                out[name] = (str(exc), time.monotonic() - start)
    dist.barrier(group=gloo)
    return out


def test_wait_bounded_by_the_stall_timeout_when_shorter():
    # the group's timeout is 60 s, $FANFOLD_STALL_TIMEOUT 2 s: rank 0 gives up after about 2 s, naming rank 1
    out = fanfold.launch(_alone_with_stall_timeout, nprocs=2, timeout=150, env={"FANFOLD_STALL_TIMEOUT": "2"})
    message, waited = out[0]["sync"]
    assert message is not None and "for rank 1" in message, message
    assert 1.5 < waited < 30, (waited, message)
    assert "rank 1" in out[0]["async"][0], out[0]["async"]  # the failed transport says so at once
