"""Smoke test of an installed fanfold: every name in ``fanfold.__all__`` and every ``fanfold`` subcommand, used once,
small, each result checked against torch (single-device torch, torch's own samplers, BatchNorm on the whole batch).

``make smoke`` runs it in a fresh venv that holds only what ``pip install .`` brings (torch, tqdm and cryptography, no
numpy), from a directory outside the repository, so the installed package is what runs. Not collected by pytest:
``tests/test_smoke_list.py`` checks that ``LOCAL``, ``RANKED`` and ``COMMANDS`` below cover every public name and
every registered subcommand.

    python tests/smoke/smoke.py                  # everything
    python tests/smoke/smoke.py --no-numpy       # and fail if numpy is importable (make smoke's fresh venv)
    python tests/smoke/smoke.py train            # only the named checks (public names or subcommands)
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fanfold
import fanfold.cli

TOL = dict(rtol=1e-5, atol=1e-6)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.allclose(x, y, **TOL):
            raise AssertionError(f"{what}: tensor {i} differs from torch's: {x} vs {y}")


# ---- checks run in this process: name -> function ---------------------------------------------------------------
def check_scatter() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    parts = fanfold.scatter(x, ["cpu", "cpu"])
    _close(list(parts), [t for t in x.chunk(2)], "scatter")


def check_scatter_kwargs() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    args, kwargs = fanfold.scatter_kwargs((x,), {"y": x + 1}, ["cpu", "cpu"])
    assert len(args) == len(kwargs) == 2
    _close([a[0] for a in args] + [k["y"] for k in kwargs], list(x.chunk(2)) + list((x + 1).chunk(2)),
           "scatter_kwargs")


def check_gather() -> None:
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    _close([fanfold.gather([a, b], "cpu")], [torch.cat([a, b])], "gather")


def check_replicate() -> None:
    net, x = _net(), torch.randn(3, 4)
    replicas = fanfold.replicate(net, ["cpu", "cpu"])
    _close([r(x) for r in replicas], [net(x)] * 2, "replicate")


def check_parallel_apply() -> None:
    net, xs = _net(), [torch.randn(3, 4), torch.randn(2, 4)]
    _close(fanfold.parallel_apply([net, net], [(x,) for x in xs]), [net(x) for x in xs], "parallel_apply")


def check_WorkerPool() -> None:
    net, xs = _net(), [torch.randn(3, 4), torch.randn(2, 4)]
    pool = fanfold.WorkerPool(threads_per_worker=1)
    for _ in range(2):  # the same threads serve the second call
        _close(fanfold.parallel_apply([net, net], [(x,) for x in xs], pool=pool), [net(x) for x in xs], "WorkerPool")


def check_data_parallel() -> None:
    net, x = _net(), torch.randn(6, 4)
    _close([fanfold.data_parallel(net, x, device_ids=["cpu", "cpu"])], [net(x)], "data_parallel")


def check_DataParallel() -> None:
    x, y = torch.randn(10, 4), torch.randint(0, 2, (10,))
    oracle = _net()
    nn.functional.cross_entropy(oracle(x), y).backward()
    for engine in ("thread", "process"):
        net = _net()
        dp = fanfold.DataParallel(net, device_ids=["cpu", "cpu"], engine=engine)
        try:
            nn.functional.cross_entropy(dp(x), y).backward()
            _close(_grads(net), _grads(oracle), f"DataParallel(engine={engine!r}) gradients")
            assert set(dp.state_dict()) == set(oracle.state_dict()), "DataParallel.state_dict() has a prefix"
        finally:
            dp.close()


def check_unwrap() -> None:
    net = _net()
    assert fanfold.unwrap(fanfold.DataParallel(net, device_ids=["cpu"])) is net


def check_launch() -> None:
    _launch_ranked(list(RANKED))


def _launch_ranked(names: list[str]) -> None:
    """The ``RANKED`` checks ``names``, in 2 gloo ranks started by ``fanfold.launch``."""
    with tempfile.TemporaryDirectory(prefix="fanfold-smoke-") as tmp:
        results = fanfold.launch(_ranked, names, tmp, nprocs=2, timeout=180)
    assert results == [names, names], results


def check_WorkerError() -> None:
    try:
        fanfold.launch(_fail, nprocs=2, timeout=60)
    except fanfold.WorkerError as exc:
        assert "rank 1" in str(exc) and "smoke: rank 1 fails" in str(exc), str(exc)
    else:
        raise AssertionError("fanfold.launch returned although rank 1 raised")


def check_launch_script() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "ranks.py")
        script.write_text("import os\nopen(os.path.join(os.path.dirname(__file__), os.environ['RANK']), 'w').close()\n")
        code = fanfold.launch_script([str(script)], nproc_per_node=2)
        assert code == 0 and sorted(os.listdir(tmp)) == ["0", "1", "ranks.py"], (code, os.listdir(tmp))


def check_StallError() -> None:
    from fanfold.distributed import InspectedTransport

    class Never:  # a transport whose all-reduce never completes: rank 1 never arrives
        def all_reduce(self, tensor, bucket=None, divisor=None):
            return torch.futures.Future()

    inspected = InspectedTransport(Never(), timeout=0.2, store=dist.HashStore(), rank=0, world_size=2)
    try:
        inspected.all_reduce(torch.ones(1), bucket=0).wait()
    except fanfold.StallError as exc:
        assert exc.missing == [1] and exc.kind == "all_reduce", exc
    else:
        raise AssertionError("a collective that never completes did not raise StallError")


def check_stall_timeout() -> None:
    from fanfold.distributed import InspectedTransport

    class Never:  # a transport whose all-reduce never completes
        def all_reduce(self, tensor, bucket=None, divisor=None):
            return torch.futures.Future()

    inspected = InspectedTransport(Never(), timeout=60, store=dist.HashStore(), rank=0, world_size=2)
    with fanfold.stall_timeout(0.2):  # this phase waits 0.2 s, not 60
        handle = inspected.all_reduce(torch.ones(1))
    try:
        handle.wait()
    except fanfold.StallError as exc:
        assert "did not complete within 0.2 s" in str(exc), exc
    else:
        raise AssertionError("a collective started inside stall_timeout(0.2) did not raise StallError")


def check_CheckpointError() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "ckpt.pt")
        fanfold.save(path, {"model": _net()})
        path.write_bytes(path.read_bytes()[:-10])  # truncated
        try:
            fanfold.load(path, {"model": _net()})
        except fanfold.CheckpointError as exc:
            assert str(path) in str(exc), exc
        else:
            raise AssertionError("a truncated checkpoint loaded")


def check_latest() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for step in (1, 2):
            fanfold.save(Path(tmp, f"step{step}.pt"), {"step": step})
            time.sleep(0.01)
        Path(tmp, "step3.pt").write_bytes(b"partial")  # not a complete checkpoint
        assert fanfold.latest(tmp) == Path(tmp, "step2.pt"), fanfold.latest(tmp)


def check_Pipeline() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(8, 4)
    pipe = fanfold.Pipeline(seq, balance=[2, 1], devices=["cpu", "cpu"], chunks=4)
    _close([pipe(x)], [seq(x)], "Pipeline forward")
    assert fanfold.pipeline.Pipeline is fanfold.Pipeline


def check_pipeline() -> None:
    assert fanfold.pipeline.DistributedPipeline is fanfold.DistributedPipeline


def check_revert_sync_batchnorm() -> None:
    bn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    synced = fanfold.SyncBatchNorm.convert_sync_batchnorm(bn)
    back = fanfold.revert_sync_batchnorm(synced)
    assert type(back[1]) is nn.BatchNorm1d, type(back[1])
    assert set(back.state_dict()) == set(bn.state_dict())


def check_FanfoldProcessGroup() -> None:
    results = fanfold.launch(_fanfold_backend, nprocs=2, timeout=120)
    assert results == [[3.0, 3.0]] * 2, results


LOCAL = {
    "scatter": check_scatter, "scatter_kwargs": check_scatter_kwargs, "gather": check_gather,
    "replicate": check_replicate, "parallel_apply": check_parallel_apply, "WorkerPool": check_WorkerPool,
    "data_parallel": check_data_parallel, "DataParallel": check_DataParallel, "unwrap": check_unwrap,
    "launch": check_launch, "launch_script": check_launch_script, "WorkerError": check_WorkerError,
    "StallError": check_StallError, "stall_timeout": check_stall_timeout, "CheckpointError": check_CheckpointError,
    "latest": check_latest,
    "Pipeline": check_Pipeline, "pipeline": check_pipeline, "revert_sync_batchnorm": check_revert_sync_batchnorm,
    "FanfoldProcessGroup": check_FanfoldProcessGroup,
}


# ---- checks run in each of 2 gloo ranks started by fanfold.launch: name -> function(rank, world, tmp) ----------
def _xs(world: int) -> torch.Tensor:
    return torch.randn(world, 3, 4, generator=torch.Generator().manual_seed(1))


def _ddp(wrapper, rank: int, world: int) -> None:
    xs, net, oracle = _xs(world), _net(), _net()
    model = wrapper(net)
    model(xs[rank]).square().sum().backward()
    (oracle(xs.reshape(-1, 4)).square().sum() / world).backward()  # DDP averages the ranks' gradients
    _close(_grads(net), _grads(oracle), f"{wrapper.__name__} on rank {rank}")


def ranked_DistributedDataParallel(rank: int, world: int, tmp: str) -> None:
    _ddp(fanfold.DistributedDataParallel, rank, world)


def ranked_DDP(rank: int, world: int, tmp: str) -> None:
    assert fanfold.DDP is fanfold.DistributedDataParallel
    _ddp(fanfold.DDP, rank, world)


def _zero(rank: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two steps of DDP + ZeRO + clipping, against torch's AdamW and clipping on the whole batch in this process."""
    xs, net, oracle = _xs(world), _net(), _net()
    model = fanfold.DDP(net)
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    torch_opt = torch.optim.AdamW(oracle.parameters(), lr=0.05)
    for _ in range(2):
        model(xs[rank]).square().sum().backward()
        norm = fanfold.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        (oracle(xs.reshape(-1, 4)).square().sum() / world).backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1.0)
        torch_opt.step()
        torch_opt.zero_grad()
        _close([norm], [torch_norm], f"clip_grad_norm_ on rank {rank}")
    _close(list(net.parameters()), list(oracle.parameters()), f"ZeroRedundancyOptimizer on rank {rank}")
    return model, opt


def ranked_ZeroRedundancyOptimizer(rank: int, world: int, tmp: str) -> None:
    _zero(rank, world)


def ranked_clip_grad_norm_(rank: int, world: int, tmp: str) -> None:
    pass  # checked against torch's clip_grad_norm_ in _zero, under ZeRO (the global norm over shards)


def ranked_DistributedSampler(rank: int, world: int, tmp: str) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    ours = list(fanfold.DistributedSampler(data, shuffle=True, seed=3))
    torchs = list(torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3))
    assert ours == torchs, (rank, ours, torchs)


def ranked_save(rank: int, world: int, tmp: str) -> None:
    """ZeRO's state and a sampler mid-epoch saved from every rank, loaded into fresh objects: the resumed sampler
    continues torch's order, the optimizer's state is the one saved."""
    model, opt = _zero(rank, world)
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    sampler = fanfold.DistributedSampler(data, shuffle=True, seed=3)
    it = iter(sampler)
    next(it), next(it)
    path = Path(tmp, "ckpt.pt")
    fanfold.save(path, {"model": model, "optimizer": opt, "sampler": sampler, "step": 2})
    opt.consolidate_state_dict(to=0)
    saved = opt.state_dict() if rank == 0 else None
    model2, opt2 = _zero(rank, world)
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    resumed = fanfold.DistributedSampler(data, shuffle=True, seed=3)
    state = fanfold.load(path, {"model": model2, "optimizer": opt2, "sampler": resumed, "step": 0})
    assert state["step"] == 2, state["step"]
    _close(list(model2.parameters()), list(model.parameters()), f"load: parameters on rank {rank}")
    whole = list(torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3))
    assert list(iter(resumed)) == whole[2:], f"rank {rank}: the resumed sampler does not continue the saved epoch"
    opt2.consolidate_state_dict(to=0)
    if rank == 0:
        loaded = opt2.state_dict()
        for key, value in saved["state"].items():
            _close([value["exp_avg"], value["exp_avg_sq"]], [loaded["state"][key]["exp_avg"],
                                                             loaded["state"][key]["exp_avg_sq"]], "load: optimizer")


def ranked_load(rank: int, world: int, tmp: str) -> None:
    pass  # checked in ranked_save: the loaded parameters, sampler position and optimizer state


def ranked_data(rank: int, world: int, tmp: str) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(11.0))
    sampler = fanfold.data.DistributedSampler(data, shuffle=False, even=False)
    mine = torch.tensor([2.0 * i for i in sampler])
    gathered = fanfold.data.gather_evaluation(mine, sampler)
    assert gathered.tolist() == [2.0 * i for i in range(11)], (rank, gathered.tolist())


def ranked_SyncBatchNorm(rank: int, world: int, tmp: str) -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    synced = fanfold.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)))
    xs = torch.randn(world, 4, 3, generator=torch.Generator().manual_seed(2))
    out = synced(xs[rank])
    _close([out, synced[0].running_mean], [bn(xs.reshape(-1, 3))[rank * 4:(rank + 1) * 4], bn.running_mean],
           f"SyncBatchNorm on rank {rank}")


def ranked_DistributedPipeline(rank: int, world: int, tmp: str) -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    oracle = nn.Sequential(*[nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)])
    oracle.load_state_dict(seq.state_dict())
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    pipe = fanfold.DistributedPipeline(seq, balance=[2, 1], chunks=3)
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.functional.mse_loss)
    torch_loss = nn.functional.mse_loss(oracle(x), y)
    torch_loss.backward()
    _close([loss.reshape(()).float()], [torch_loss.detach()], f"DistributedPipeline loss on rank {rank}")
    mine = [p.grad for p in pipe.parameters()]
    start = 0 if pipe.is_first else 2
    theirs = [p.grad for layer in list(oracle)[start:start + pipe.balance[pipe.stage]] for p in layer.parameters()]
    _close(mine, theirs, f"DistributedPipeline gradients on rank {rank}")


RANKED = {
    "DistributedDataParallel": ranked_DistributedDataParallel, "DDP": ranked_DDP,
    "ZeroRedundancyOptimizer": ranked_ZeroRedundancyOptimizer, "clip_grad_norm_": ranked_clip_grad_norm_,
    "DistributedSampler": ranked_DistributedSampler, "save": ranked_save, "load": ranked_load, "data": ranked_data,
    "SyncBatchNorm": ranked_SyncBatchNorm, "DistributedPipeline": ranked_DistributedPipeline,
}


def _ranked(names: list[str], tmp: str) -> list[str]:
    fanfold.distributed.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in names:
        RANKED[name](rank, world, tmp)
    fanfold.distributed.destroy_process_group()
    return names


def _fail() -> None:
    fanfold.distributed.init_process_group("gloo")
    if fanfold.distributed.rank() == 1:
        raise ValueError("smoke: rank 1 fails")
    fanfold.distributed.destroy_process_group()


def _fanfold_backend() -> list[float]:
    dist.init_process_group("fanfold")
    assert isinstance(dist.group.WORLD, fanfold.FanfoldProcessGroup), type(dist.group.WORLD)
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.tolist()


# ---- the command line: subcommand -> argument lists, each run as `fanfold ...` and expected to exit 0 ------------
def _train_extra() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("sklearn", "matplotlib"))


def command_demo(tmp: str) -> None:
    _fanfold(["demo", "--devices", "2", "--data-size", "20", "--batch-size", "10"], tmp)


def command_run(tmp: str) -> None:
    script = Path(tmp, "ddp.py")
    script.write_text(
        "import torch\nimport fanfold\nfrom fanfold import distributed as fd\n"
        "fd.init_process_group()\n"
        "model = fanfold.DDP(torch.nn.Linear(2, 1))\n"
        "model(torch.ones(1, 2)).sum().backward()\n"
        "assert fd.world_size() == 2\n"
        "fd.destroy_process_group()\n")
    _fanfold(["run", "-n", "2", str(script)], tmp)


def command_doctor(tmp: str) -> None:
    _fanfold(["doctor"], tmp)


def command_train(tmp: str) -> None:
    args = ["train", "--devices", "2", "--epochs", "1", "--batch-size", "240", "--out", str(Path(tmp, "run"))]
    if _train_extra():
        _fanfold(args, tmp)
        assert Path(tmp, "run", "checkpoint.pt").is_file() and Path(tmp, "run", "loss.png").is_file()
        return
    # without the train extra (scikit-learn for the data, matplotlib for the plot) it refuses, naming the extra
    run = subprocess.run(["fanfold", *args], cwd=tmp, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "fanfold[train]" in run.stderr, (run.returncode, run.stderr[-2000:])


def command_secret(tmp: str) -> None:
    printed = subprocess.run(["fanfold", "secret"], cwd=tmp, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0 and re.fullmatch(r"[0-9a-f]{64}\n", printed.stdout), printed
    path = Path(tmp, "job-secret")
    _fanfold(["secret", "--file", str(path)], tmp)
    assert path.stat().st_mode & 0o777 == 0o600 and re.fullmatch(r"[0-9a-f]{64}\n", path.read_text())


COMMANDS = {"demo": command_demo, "run": command_run, "doctor": command_doctor, "train": command_train,
            "secret": command_secret}


def _fanfold(args: list[str], cwd: str) -> None:
    run = subprocess.run(["fanfold", *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise AssertionError(f"`fanfold {' '.join(args)}` exited {run.returncode}:\n{run.stdout[-3000:]}\n"
                             f"{run.stderr[-3000:]}")


def _help(tmp: str) -> None:
    """``fanfold --help`` through the installed entry point; ``--version`` and each subcommand's ``--help`` in this
    process (the same parser, without importing torch once per command)."""
    _fanfold(["--help"], tmp)
    for args in (["--version"], *([name, "--help"] for name in COMMANDS)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                fanfold.cli.main(args)
            except SystemExit as exc:
                assert exc.code in (0, None), f"`fanfold {' '.join(args)}` exited {exc.code}"
        assert out.getvalue().strip(), f"`fanfold {' '.join(args)}` printed nothing"


# ---- main ---------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-numpy", action="store_true", help="fail if numpy is importable here")
    parser.add_argument("only", nargs="*", help="run only these checks (public names or subcommands)")
    args = parser.parse_args(argv)
    unknown = set(args.only) - set(LOCAL) - set(RANKED) - set(COMMANDS)
    if unknown:
        parser.error(f"no such check: {sorted(unknown)}")
    if args.no_numpy and importlib.util.find_spec("numpy") is not None:
        raise SystemExit("smoke: numpy is importable, but --no-numpy says this environment must not hold it")
    print(f"smoke: fanfold {fanfold.__version__} from {Path(fanfold.__file__).parent}, torch {torch.__version__}, "
          f"numpy {'present' if importlib.util.find_spec('numpy') else 'absent'}", flush=True)
    chosen = args.only or [*LOCAL, *COMMANDS, "--help"]
    # the ranked checks run together, in the ranks of one fanfold.launch (check_launch runs them all)
    steps = {name: LOCAL[name] for name in chosen if name in LOCAL}
    ranked = [name for name in chosen if name in RANKED]
    if ranked and "launch" not in steps:
        steps[f"launch: {' '.join(ranked)}"] = lambda: _launch_ranked(ranked)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="fanfold-smoke-") as tmp:
        steps.update({f"fanfold {name}": functools.partial(COMMANDS[name], tmp) for name in chosen if name in COMMANDS})
        if "--help" in chosen:
            steps["fanfold --help, --version, every subcommand's --help"] = functools.partial(_help, tmp)
        for name, step in steps.items():
            start = time.perf_counter()
            try:
                step()
            except Exception as exc:
                failed += 1
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
            else:
                print(f"ok   {name} ({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"smoke: {len(steps) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
