"""fanfold with its declared dependencies only (torch, tqdm, cryptography): numpy made unimportable in a fresh
interpreter and in every rank it launches, then ZeRO, save/load of a sampler mid-epoch, exact evaluation and a spilled
process-engine message. torch's object collectives fail there with "Numpy is not available"; the results are checked
against torch's Adam on the whole batch in one process and against the dataset itself."""
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

SCRIPT = r'''
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import fanfold
from fanfold import distributed as fd


def numpy_blocked():
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        return False
    try:
        torch.zeros(1).numpy()
    except RuntimeError as exc:
        return "Numpy is not available" in str(exc)
    return False


def job(path):
    fd.init_process_group("gloo")
    rank, world = fd.rank(), fd.world_size()
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    oracle = nn.Linear(4, 2)
    oracle.load_state_dict(net.state_dict())
    model = fanfold.DDP(net)
    opt = fanfold.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    xs = torch.randn(world, 3, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(xs[rank]).square().sum().backward()
        opt.step()
        opt.zero_grad()
    # the oracle: one process, the whole batch, the gradient DDP averages
    torch_opt = torch.optim.Adam(oracle.parameters(), lr=0.1)
    for _ in range(2):
        (oracle(xs.reshape(-1, 4)).square().sum(dim=1).reshape(world, 3).sum(1).mean()).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    same_params = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(net.parameters(),
                                                                                   oracle.parameters()))

    data = TensorDataset(torch.arange(10.0))
    sampler = fanfold.DistributedSampler(data, shuffle=True, seed=3)
    it = iter(sampler)
    next(it), next(it)  # two samples of the epoch consumed, then a checkpoint, then a resume
    fanfold.save(path, {"model": model, "optimizer": opt, "sampler": sampler})
    resumed = fanfold.DistributedSampler(data, shuffle=True, seed=3)
    fanfold.load(path, {"model": model, "optimizer": opt, "sampler": resumed})
    whole = list(torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3))
    same_rest = list(iter(resumed)) == whole[2:]

    evaluation = fanfold.DistributedSampler(data, shuffle=False, even=False)
    mine = torch.tensor([float(data[i][0]) * 2 for i in evaluation])
    gathered = fanfold.data.gather_evaluation(mine, evaluation)
    fd.destroy_process_group()
    return numpy_blocked(), same_params, same_rest, gathered.tolist()


if __name__ == "__main__":
    assert numpy_blocked(), "numpy is importable: this check must run without it"

    for rank, (blocked, same_params, same_rest, gathered) in enumerate(fanfold.launch(job, sys.argv[1], nprocs=2,
                                                                                       timeout=120)):
        assert blocked, f"rank {rank} could import numpy"
        assert same_params, f"rank {rank}: ZeRO's parameters differ from torch's Adam on the whole batch"
        assert same_rest, f"rank {rank}: the resumed sampler does not continue the saved epoch"
        assert gathered == [2.0 * i for i in range(10)], (rank, gathered)

    from fanfold.parallel.process_engine import _AREA, WORKER, Mailbox

    caller = Mailbox()
    worker = Mailbox(caller.block, WORKER)
    big = list(range(3 * _AREA // 8))  # pickles to more than a mailbox's area: spilled into a shared buffer
    caller.send(big)
    assert worker.receive(lambda: None, time.monotonic() + 30) == big
    print("no-numpy run: ok")
'''


def test_runs_without_numpy(tmp_path):
    stub = tmp_path / "stub" / "numpy"
    stub.mkdir(parents=True)
    # an import of numpy fails as in an environment without it, in this interpreter and every process it starts
    # (ModuleNotFoundError, as torch's optional imports expect)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), str(SRC)])}
    run = subprocess.run([sys.executable, str(tmp_path / "job.py"), str(tmp_path / "ckpt.pt")], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "no-numpy run: ok" in run.stdout
