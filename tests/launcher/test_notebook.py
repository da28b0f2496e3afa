"""fanfold.launch from a real Jupyter kernel: a function defined in a notebook cell runs on 2 workers.

The notebook is built here and executed by nbclient with ipykernel (test dependencies). Cell 1 defines a model and
a training function (fanfold's DDP, 2 gloo ranks, each on half of a fixed batch); cell 2 launches it on 2 workers
and prints the result; cell 3 trains the same model in the kernel's own process on the whole batch (the oracle) and
prints whether both ranks match it; cell 4 launches a cell-defined function whose rank 1 raises, and prints the
WorkerError; cell 5 has both workers print a line in pieces, rank 0 pausing mid-line while rank 1 prints its own
(whole lines must arrive, not "workerworker 1  done0"), then the same with ``rank_prefix=True``; cell 6 launches a
function whose ranks stall (rank 1 skips a backward's all-reduce): a WorkerError with the StallError, and cell 7 shows
the kernel lives on. Cells cannot be
pickled by reference, so this is the path a notebook user takes.
"""
from __future__ import annotations

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

CELLS = [
    '''
import os, torch
from torch import nn
import fanfold
from fanfold.distributed import init_process_group, destroy_process_group

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)

def train(steps):
    init_process_group(timeout=60.0)
    rank = int(os.environ["RANK"])
    model = fanfold.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        opt.step()
    destroy_process_group()
    return [p.detach().clone() for p in model.module.parameters()]
''',
    '''
results = fanfold.launch(train, 5, nprocs=2, timeout=90)
print("workers:", len(results), "params:", [tuple(p.shape) for p in results[0]])
''',
    '''
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = batch()
for _ in range(5):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
for rank in (0, 1):
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results[rank], model.parameters()))
    print(f"rank {rank} matches one process:", same)
print("cuda initialised in the kernel:", torch.cuda.is_initialized())
''',
    '''
def broken():
    if os.environ["RANK"] == "1":
        raise ValueError("bad cell on rank 1")
    return 0

try:
    fanfold.launch(broken, nprocs=2, timeout=60)
except fanfold.WorkerError as e:
    print("WorkerError rank", e.rank, "|", str(e).splitlines()[0])
''',
    '''
import shutil, tempfile, time

def chatty(folder):
    # rank 1 prints its whole line while rank 0 is in the middle of its own (files order the two, bounded waits)
    def wait_for(name):
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(folder, name)) and time.monotonic() < deadline:
            time.sleep(0.01)

    if os.environ["RANK"] == "0":
        print("worker", end="", flush=True)
        time.sleep(0.3)
        open(os.path.join(folder, "mid-line"), "w").close()
        wait_for("rank1-done")
        print("", 0, "done")
    else:
        wait_for("mid-line")
        print("worker", 1, "done", flush=True)
        time.sleep(0.3)
        open(os.path.join(folder, "rank1-done"), "w").close()

for prefix in (False, True):
    folder = tempfile.mkdtemp()
    try:
        fanfold.launch(chatty, folder, nprocs=2, timeout=60, rank_prefix=prefix)
    finally:
        shutil.rmtree(folder)
''',
    '''
def stalls():
    init_process_group(timeout=60.0)
    model = fanfold.DistributedDataParallel(make_model())
    x, y = batch()
    if os.environ["RANK"] == "0":
        nn.functional.mse_loss(model(x), y).backward()  # rank 1 never joins this backward's all-reduce
    else:
        fanfold.distributed.barrier()  # ended by rank 0's diagnosis, not left waiting
    return 0

try:
    fanfold.launch(stalls, nprocs=2, timeout=60, env={"FANFOLD_STALL_TIMEOUT": "2"})
except fanfold.WorkerError as e:
    print("stalled:", "StallError" in str(e), "| ranks stopped:", "also failed" in str(e) or "stopped" in str(e))
''',
    '''
print("the kernel lives on:", sum(p.numel() for p in make_model().parameters()))
''',
]


@pytest.mark.timeout(180)
def test_function_defined_in_a_notebook_runs_on_two_workers():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src.strip()) for src in CELLS]
    client = nbclient.NotebookClient(nb, timeout=150, kernel_name="python3")  # the kernel inherits our environment
    client.execute()
    outputs = ["".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
               for cell in nb.cells]
    assert outputs[1] == "workers: 2 params: [(8, 4), (8,), (1, 8), (1,)]\n", outputs
    assert outputs[2] == ("rank 0 matches one process: True\nrank 1 matches one process: True\n"
                          "cuda initialised in the kernel: False\n"), outputs
    assert outputs[3] == "WorkerError rank 1 | rank 1 of 2 failed: ValueError: bad cell on rank 1\n", outputs
    assert outputs[4] == ("worker 1 done\nworker 0 done\n"
                          "[rank 1] worker 1 done\n[rank 0] worker 0 done\n"), outputs
    # a stall in a notebook: the workers end with the diagnosis, the kernel does not
    assert outputs[5] == "stalled: True | ranks stopped: True\n", outputs
    assert outputs[6] == "the kernel lives on: 49\n", outputs
