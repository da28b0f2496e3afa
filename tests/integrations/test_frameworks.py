"""Lightning, Accelerate and the transformers Trainer on the ``fanfold`` backend, each a seeded 2-process CPU job
(tests/integrations/_*_job.py) launched the framework's way (Lightning's own launcher; ``fanfold run -n 2``, torchrun's
contract, for the others), run once on gloo, the oracle, and once switched to fanfold: the final parameters, the
logged metrics and what every distributed utility returned are bitwise gloo's, gradient accumulation included. The
routes that would train unwrapped replicas fail loudly. Skipped where a framework is not installed: `make
integrations` installs the pinned ones (pyproject.toml's `integrations` extra) in a venv of its own."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fanfold.distributed import free_port

HERE = Path(__file__).resolve().parent
FANFOLD = [sys.executable, "-c", "import sys; from fanfold.cli import main; sys.exit(main())", "run", "-n", "2"]
pytestmark = pytest.mark.timeout(1500)


def _run(cmd: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own (the ranks a framework's launcher starts die with it on a timeout)."""
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd} ran past {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _job(cmd: list[str], out: Path, env: dict | None = None) -> dict:
    run = _run([*cmd, str(out)], env)
    assert run.returncode == 0, run.stdout[-6000:]
    return torch.load(out, weights_only=False)


def _equal(a, b) -> bool:
    """Bitwise, dtype included, through dicts, lists and tuples."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _lightning(kind: str, tmp: Path) -> dict:
    pytest.importorskip("lightning")
    return _job([sys.executable, str(HERE / "_lightning_job.py"), kind], tmp / f"lightning-{kind}.pt",
                {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


@pytest.fixture(scope="module")
def lightning_gloo(tmp_path_factory) -> dict:
    return _lightning("gloo", tmp_path_factory.mktemp("lightning"))


@pytest.mark.parametrize("kind", ["fanfold", "fanfold_ddp"])
def test_lightning_matches_gloo(kind, lightning_gloo, tmp_path):
    # fanfold: DDPStrategy(process_group_backend="fanfold"), torch's DDP; its sync_dist logging sends integer AVG
    # fanfold_ddp: FanfoldDDPStrategy, fanfold's DDP (no_sync for accumulate_grad_batches)
    got, want = _lightning(kind, tmp_path), lightning_gloo
    assert (want["backend"], got["backend"]) == ("gloo", "fanfold")
    assert got["wrapper"] == ("fanfold.distributed.ddp.DistributedDataParallel" if kind == "fanfold_ddp" else
                              "torch.nn.parallel.distributed.DistributedDataParallel")
    for key in ("params", "metrics", "calls"):
        assert _equal(got[key], want[key]), (key, got[key], want[key])
    # a mean of integers: the sum over the ranks divided, rounding toward zero on both backends
    assert want["calls"]["reduce mean int 1"].tolist() == [17, -17, 5]


def test_accelerate_matches_gloo(tmp_path):
    pytest.importorskip("accelerate")
    job = [*FANFOLD, str(HERE / "_accelerate_job.py")]
    want, got = (_job([*job, mode], tmp_path / f"{mode}.pt") for mode in ("gloo", "fanfold"))
    assert (want["backend"], got["backend"]) == ("gloo", "fanfold")
    assert got["wrapped"] == want["wrapped"] == "torch.nn.parallel.distributed" and got["processes"] == 2
    assert got["state_backend"] == "gloo"  # Accelerate's own idea of the backend (docs/integrations.md, Limits)
    assert _equal(got["params"], want["params"]) and _equal(got["calls"], want["calls"]), (got, want)


def test_trainer_matches_gloo(tmp_path):
    pytest.importorskip("transformers")
    job = [*FANFOLD, str(HERE / "_trainer_job.py")]
    want, got = (_job([*job, mode], tmp_path / f"{mode}.pt") for mode in ("gloo", "fanfold"))
    assert (want["backend"], got["backend"], got["processes"]) == ("gloo", "fanfold", 2)
    assert _equal(got["params"], want["params"])
    timings = ("runtime", "per_second")
    strip = [[{k: v for k, v in d.items() if not k.endswith(timings)} for d in x["log"] + [x["metrics"]]]
             for x in (got, want)]
    assert strip[0] == strip[1] and want["metrics"]["eval_seen"] == 23.0


@pytest.mark.parametrize("job, mode", [("_accelerate_job.py", "kwargs"), ("_trainer_job.py", "ddp_backend")])
def test_routes_that_would_not_wrap_fail_loudly(job, mode, tmp_path):
    # Accelerate's InitProcessGroupKwargs(backend="fanfold") and the Trainer's ddp_backend="fanfold", without the
    # CPU flag on a machine without an accelerator: Accelerate creates the group but would not wrap the model
    pytest.importorskip("transformers" if "trainer" in job else "accelerate")
    run = _run([*FANFOLD, str(HERE / job), mode, str(tmp_path / "never.pt")])
    assert run.returncode != 0 and "distributed_type NO: it would not wrap the model" in run.stdout, run.stdout[-4000:]
    assert not (tmp_path / "never.pt").exists()


def test_lightning_strategy_is_imported_on_demand(tmp_path):
    pytest.importorskip("lightning")
    code = ("import sys, fanfold; assert 'lightning' not in sys.modules and 'fanfold.integrations' not in sys.modules; "
            "from fanfold.integrations.lightning import FanfoldDDPStrategy; "
            "from lightning.pytorch.strategies import StrategyRegistry; "
            "s = StrategyRegistry.get('fanfold_ddp'); assert type(s) is FanfoldDDPStrategy, s; "
            "assert s.process_group_backend == 'fanfold'; print('ok')")
    run = _run([sys.executable, "-c", code], timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-3000:]
