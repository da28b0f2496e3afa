"""The examples run as their docstrings say, and check their own results (a failed check exits non-zero).

`examples/train_ddp.py` runs in one process, under `fanfold run -n 2` and under torch's own launcher
(`python -m torch.distributed.run`, i.e. torchrun): the same script, the same environment contract.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_ddp.py")
TIMEOUT = 240  # shared CPU: generous, never relied on


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("launch", [
    [],
    ["-m", "fanfold", "run", "-n", "2"],
    ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
], ids=["one-process", "fanfold-run", "torchrun"])
def test_train_ddp_checks_itself(launch):
    res = _run(*launch, EXAMPLE, "--steps", "30")
    assert res.returncode == 0, res.stdout + res.stderr
    world = 2 if launch else 1
    assert f"{world} process(es)" in res.stdout
    assert res.stdout.rstrip().endswith("ok")  # loss fell, ranks agree, equal to the single-process replay


MODEL_SPLIT = str(ROOT / "examples" / "model_split.py")


@pytest.mark.parametrize("launch,where", [
    ([], "one process"),
    (["-m", "fanfold", "run", "-n", "2"], "one stage per process"),
], ids=["one-process", "fanfold-run"])
def test_model_split_checks_itself_on_the_cpu(launch, where):
    res = _run(*launch, MODEL_SPLIT, "--devices", "cpu", "cpu", "--schedule", "gpipe", "--chunks", "3",
               "--steps", "40")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith(f"cpu + cpu, 3 micro-batches, gpipe, {where}")
    assert res.stdout.rstrip().endswith("ok")  # loss fell, weights equal the hand-split model's


@pytest.mark.gpu
def test_model_split_runs_as_written_on_a_gpu():
    res = _run(MODEL_SPLIT)  # the notes' placement: devices ["cpu", "cuda:0"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("cpu + cuda:0")
    assert res.stdout.rstrip().endswith("ok")


UNET = str(ROOT / "examples" / "unet_skips.py")


def test_unet_skips_checks_itself():
    res = _run(UNET, "--stages", "4", "--chunks", "3", "--checkpoint", "always")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("equals the unsplit model's") == 3  # a plain backward and two schedules
    assert res.stdout.rstrip().endswith("the split U-Net equals the unsplit one: outputs, losses and gradients")
