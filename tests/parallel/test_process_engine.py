"""DataParallel(engine="process"): replicas in worker processes, checked against the bare module (outputs, input and
parameter gradients, parameters after SGD and Adam steps), and its robustness (errors, a killed worker, restarts,
close). Every engine starts real processes: the models and batches are small."""
import copy
import multiprocessing
import os
import re
import signal
import threading
import time

import pytest
import torch
from torch import nn

from fanfold import DataParallel
from fanfold.training.job import make_model

TOL = dict(rtol=1e-4, atol=1e-5)


class LSTMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class Nested(nn.Module):
    """Keyword arguments in, a dict with a tuple and a non-differentiable tensor out."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, *, scale, offset=0.0):
        y = self.fc(x) * scale + offset
        return {"y": y, "pair": (y.tanh(), x.sum(1)), "label": y.argmax(1)}


class FailsOnNegativeSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum() < 0:
            raise ValueError(f"negative chunk of {len(x)} rows")
        return self.fc(x)


class Sleepy(nn.Module):
    def __init__(self, seconds, awake=None):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.seconds, self.awake = seconds, awake  # a process that does not sleep (the caller runs replica 0)

    def forward(self, x):
        if os.getpid() != self.awake:
            time.sleep(self.seconds)
        return self.fc(x)


def digits_cnn():
    model = make_model()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # the bare module and the replicas would draw different masks
    return model


def mlp():
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4))


MODELS = {  # the model and a batch of 12 drawn from a generator
    "mlp": (mlp, lambda g: torch.randn(12, 10, generator=g)),
    "cnn": (digits_cnn, lambda g: torch.randn(12, 1, 8, 8, generator=g)),
    "lstm": (LSTMHead, lambda g: torch.randn(12, 5, 6, generator=g)),
}


def assert_same_parameters(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{what}: {name}: {m}")


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_matches_the_bare_module(name, replicas):
    build, data = MODELS[name]
    torch.manual_seed(0)
    bare = build()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * replicas, engine="process")
    g = torch.Generator().manual_seed(1)
    try:
        for opt_cls, kw in ((torch.optim.SGD, dict(lr=0.05, momentum=0.9)), (torch.optim.Adam, dict(lr=1e-3))):
            opts = [opt_cls(m.parameters(), **kw) for m in (bare, dp.module)]
            for step in range(20):
                x = data(g)
                xs = [x.clone().requires_grad_(True) for _ in range(2)]
                outs = [bare(xs[0]), dp(xs[1])]
                torch.testing.assert_close(outs[1], outs[0], **TOL)
                for out in outs:
                    out.pow(2).mean().backward()
                torch.testing.assert_close(xs[1].grad, xs[0].grad, **TOL)
                for p, q in zip(bare.parameters(), dp.module.parameters(), strict=True):
                    torch.testing.assert_close(q.grad, p.grad, **TOL)
                for opt in opts:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            assert_same_parameters(dp.module, bare, f"after 20 {opt_cls.__name__} steps")
    finally:
        dp.close()


def test_kwargs_nested_outputs_accumulation_and_hooks():
    torch.manual_seed(0)
    bare = Nested()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, engine="process")
    calls = []
    dp.module.fc.weight.register_hook(lambda grad: calls.append(grad.clone()))
    try:
        for micro in range(3):  # gradient accumulation: .grad created by the first, added to by the others
            x, scale = torch.randn(6, 4), torch.rand(6, 1)
            args = [(x.clone().requires_grad_(True), scale.clone().requires_grad_(True)) for _ in range(2)]
            expected = bare(args[0][0], scale=args[0][1], offset=0.5)
            got = dp(args[1][0], scale=args[1][1], offset=0.5)
            assert set(got) == {"y", "pair", "label"} and isinstance(got["pair"], tuple)
            assert got["label"].dtype == torch.int64 and not got["label"].requires_grad
            for key in ("y", "label"):
                torch.testing.assert_close(got[key], expected[key], **TOL)
            torch.testing.assert_close(got["pair"], expected["pair"], **TOL)
            for out in (expected, got):
                (out["y"].pow(2).sum() + out["pair"][0].sum() + out["pair"][1].pow(2).sum()).backward()
            torch.testing.assert_close(args[1][0].grad, args[0][0].grad, **TOL)
            torch.testing.assert_close(args[1][1].grad, args[0][1].grad, **TOL)
        for p, q in zip(bare.parameters(), dp.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, **TOL)
        assert len(calls) == 3  # the parameter hook ran once per backward, in the caller, on the summed gradient
        torch.testing.assert_close(sum(calls), dp.module.fc.weight.grad, **TOL)
        workers = list(dp._processes._procs)
        one_row = torch.randn(1, 4)  # fewer rows than replicas: the first worker alone, no restart
        torch.testing.assert_close(dp(one_row, scale=torch.ones(1, 1))["y"], bare(one_row, scale=torch.ones(1, 1))["y"],
                                   **TOL)
        assert dp._processes._procs == workers
    finally:
        dp.close()


def test_no_grad_eval_and_batchnorm_statistics():
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, engine="process")
    x = torch.randn(8, 4)
    try:
        dp(x)  # train mode: as torch's DataParallel, the statistics come from replica 0's chunk (the first half)
        bare(x[:4])
        torch.testing.assert_close(dp.module[1].running_mean, bare[1].running_mean, **TOL)
        torch.testing.assert_close(dp.module[1].running_var, bare[1].running_var, **TOL)
        assert int(dp.module[1].num_batches_tracked) == 1
        dp.eval()
        bare.eval()
        with torch.no_grad():
            out = dp(x)
        assert not out.requires_grad
        torch.testing.assert_close(out, bare(x), **TOL)
        torch.testing.assert_close(dp.module[1].running_mean, bare[1].running_mean, **TOL)  # eval: no update
    finally:
        dp.close()


def test_an_error_names_the_replica_and_carries_its_traceback_and_the_pool_survives():
    torch.manual_seed(0)
    dp = DataParallel(FailsOnNegativeSum(), ["cpu"] * 2, engine="process")
    x = torch.cat([torch.ones(3, 2), -torch.ones(3, 2)])
    try:
        with pytest.raises(ValueError, match=r"(?s)in replica 1 .*negative chunk of 3 rows.*Traceback in the worker"):
            dp(x)
        y = torch.ones(6, 2)
        torch.testing.assert_close(dp(y), dp.module(y), **TOL)
    finally:
        dp.close()


def test_a_killed_worker_is_an_error_within_seconds_and_the_next_call_restarts():
    torch.manual_seed(0)
    bare = nn.Linear(3, 2)
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, engine="process")
    x = torch.randn(4, 3)
    try:
        dp(x)
        victim = dp._processes._procs[0]  # the caller runs replica 0 itself: the first worker runs replica 1
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker process of replica 1 died"):
            dp(x)
        assert time.monotonic() - start < 10
        out = dp(x)  # a fresh pool
        torch.testing.assert_close(out, bare(x), **TOL)
        # a worker killed between forward and backward: the backward fails, the next step works
        out = dp(x)
        os.kill(dp._processes._procs[0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="worker process of replica 1 died during backward"):
            out.sum().backward()
        dp(x).sum().backward()
        out = dp(x)  # the workers stopped, or restarted, between forward and backward: a clear error
        dp.close()
        with pytest.raises(RuntimeError, match="workers were stopped since this forward"):
            out.sum().backward()
        out = dp(x)
        dp.module.weight = nn.Parameter(dp.module.weight.detach().clone())
        dp(x)
        with pytest.raises(RuntimeError, match=r"stopped since this forward .* or restarted \(a structure"):
            out.sum().backward()
    finally:
        dp.close()


@pytest.mark.parametrize("caller_sleeps", [True, False])  # else the caller waits in a mailbox for the worker
def test_ctrl_c_during_a_step_stops_the_workers_and_the_next_call_restarts(caller_sleeps):
    dp = DataParallel(Sleepy(30.0, None if caller_sleeps else os.getpid()), ["cpu"] * 2, engine="process")
    x = torch.randn(4, 2)
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            dp(x)  # the replicas sleep for 30 s: the interrupt comes first (or during their start)
        assert time.monotonic() - start < 20
        assert not [p for p in multiprocessing.active_children() if p.name.startswith("fanfold-replica")]
        dp.module.seconds = 0.0
        torch.testing.assert_close(dp(x), dp.module(x), **TOL)
    finally:
        timer.cancel()
        dp.close()


def test_structure_change_restarts_close_stops_workers_and_shm_is_clean():
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, engine="process")
    x = torch.randn(4, 3)
    dp(x)
    first = list(dp._processes._procs)
    replacement = nn.Linear(4, 2)
    bare[1] = replacement
    dp.module[1] = copy.deepcopy(replacement)  # the workers hold the old layer: they must be restarted
    torch.testing.assert_close(dp(x), bare(x), **TOL)
    assert all(not p.is_alive() for p in first)
    with torch.no_grad():
        dp.module[0].weight.add_(1.0)  # an in-place update (an optimizer step) needs no restart: memory is shared
        bare[0].weight.add_(1.0)
    second = list(dp._processes._procs)
    torch.testing.assert_close(dp(x), bare(x), **TOL)
    assert dp._processes._procs == second
    dp.close()
    assert all(not p.is_alive() for p in second)
    if os.path.isdir("/dev/shm"):
        # only names made by this process or its workers (torch's and fanfold's carry the creator's pid): other
        # jobs on the machine come and go in /dev/shm meanwhile
        ours = {str(p.pid) for p in first + second} | {str(os.getpid())}
        new = set(os.listdir("/dev/shm")) - shm_before
        assert {n for n in new if ours & set(re.findall(r"[0-9]+", n))} == set()


def test_a_class_defined_in_main_is_forked_like_a_notebook_cell():
    # a forkserver child cannot import a class of __main__ (a notebook cell); the engine forks such workers
    cell_class = type("CellModel", (nn.Module,), {
        "__init__": lambda self: (nn.Module.__init__(self), setattr(self, "fc", nn.Linear(3, 2)))[0],
        "forward": lambda self, x: self.fc(x).tanh(),
        "__module__": "__main__",
    })
    torch.manual_seed(0)
    bare = cell_class()
    dp = DataParallel(copy.deepcopy(bare), ["cpu"] * 2, engine="process")
    x = torch.randn(6, 3)
    try:
        out = dp(x)
        assert dp._processes._procs[0]._popen.method == "fork"
        torch.testing.assert_close(out, bare(x), **TOL)
        out.sum().backward()
        bare(x).sum().backward()
        for p, q in zip(bare.parameters(), dp.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, **TOL)
    finally:
        dp.close()


def test_double_backward_is_refused_and_process_needs_cpu_devices():
    dp = DataParallel(nn.Linear(3, 1), ["cpu"] * 2, engine="process")
    x = torch.randn(4, 3, requires_grad=True)
    try:
        with pytest.raises(RuntimeError, match=r"double backward.*engine='thread'"):
            torch.autograd.grad(dp(x).sum(), x, create_graph=True)
    finally:
        dp.close()
    with pytest.raises(ValueError, match="engine must be 'thread' or 'process'"):
        DataParallel(nn.Linear(3, 1), ["cpu"] * 2, engine="processes")
    with pytest.raises(ValueError, match="engine='process' runs CPU replicas only"):
        DataParallel(nn.Linear(3, 1), ["cpu", "meta"], engine="process")


@pytest.mark.parametrize("fmt", [torch.channels_last, torch.contiguous_format])
def test_outputs_and_gradients_keep_their_memory_format_as_on_the_thread_engine(fmt):
    # issue 26: the process engine returned channels_last outputs as contiguous tensors; the bare module's and the
    # thread engine's keep the format
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1).to(memory_format=fmt)
    x = torch.randn(4, 3, 6, 6).to(memory_format=fmt).requires_grad_()
    want = conv(x)
    want.sum().backward()
    want_x_grad, x.grad = x.grad, None
    dp = DataParallel(conv, ["cpu", "cpu"], engine="process")
    try:
        got = dp(x)
        got.sum().backward()
    finally:
        dp.close()
    assert got.is_contiguous(memory_format=fmt) == want.is_contiguous(memory_format=fmt)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, want_x_grad)
