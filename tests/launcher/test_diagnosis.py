"""What a user sees when a rank stalls or its peer dies: a real 2-rank script under ``fanfold run`` and
``fanfold.launch``. The report starts with fanfold's one-line diagnosis, the user's own line (the oracle: the
script's text, found by its marker) comes before any frame of fanfold, and no frame of fanfold's package shows at
all, unless ``FANFOLD_DEBUG=1``, which shows them and the chained transport error.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

import fanfold

TIMEOUT = 240  # the CPU is shared with other test runs: generous, never relied on
PACKAGE = str(Path(fanfold.__file__).resolve().parent)
MARK = "# <- the user's line"

SCRIPT = textwrap.dedent(f"""
    import os, time
    import torch, torch.distributed as dist
    from torch import nn
    import fanfold

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = fanfold.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if rank == 1 and step == 1 and os.environ["CASE"] == "skip":
            continue  # the bug: rank 1 skips one backward
        if rank == 1 and step == 2 and os.environ["CASE"] == "exits":
            os._exit(0)  # gone while rank 0 waits in this step's all_reduce
        loss.backward()  {MARK}
        opt.step()
        opt.zero_grad()
    if rank == 1:
        time.sleep(120)  # rank 1 alone, e.g. evaluating: rank 0 waits in its last backward's all-reduce
    fanfold.save("ckpt.pt", {{"model": model.state_dict()}})
""")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "FANFOLD_DEBUG")}
    return {**env, "FANFOLD_STALL_TIMEOUT": "5", **extra}


def _run(tmp_path: Path, *flags: str, **env: str) -> list[str]:
    (tmp_path / "train.py").write_text(SCRIPT)
    res = subprocess.run([sys.executable, "-m", "fanfold", "run", "-n", "2", *flags, "train.py"], cwd=tmp_path,
                         env=_env(**env), capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 1, res.stderr
    return res.stderr.splitlines()


def _user_frame(path: str) -> list[str]:
    """The two lines of the user's frame, from the script's own text."""
    number = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if MARK in line)
    return [f'  File "{path}", line {number}, in <module>', "    loss.backward()  " + MARK]


def _check(block: list[str], frame: list[str], *, debug: bool = False) -> None:
    """``block``: one rank's traceback as shown; the user's frame comes first, fanfold's only with ``debug``."""
    text = "\n".join(block)
    at = next((i for i in range(len(block) - 1) if block[i:i + 2] == frame), None)
    assert at is not None, text
    fanfold_frames = [i for i, line in enumerate(block) if line.startswith("  File ") and PACKAGE in line]
    if debug:
        assert fanfold_frames, text
        assert "ShmTimeoutError" in text and "The above exception was the direct cause" in text, text
    else:
        assert fanfold_frames == [] and PACKAGE not in text, text
        assert block[:2] == ["Traceback (most recent call last):", frame[0]], text  # the script's frame first
        assert "During handling" not in text and "direct cause" not in text, text  # no chained internals
        assert block[-1] == "(fanfold's own frames are hidden; FANFOLD_DEBUG=1 shows the full traceback)", text


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("debug", [False, True])
def test_a_skipped_backward_reads_first_under_fanfold_run(tmp_path, debug):
    lines = _run(tmp_path, **({"FANFOLD_DEBUG": "1"} if debug else {}), CASE="skip")
    # the launcher's line, then the headline: rank 0 waited its stall timeout for rank 1, busy alone
    assert re.fullmatch(r"fanfold run: rank 0 \(local rank 0, pid \d+\) failed with exit code 1", lines[0]), lines
    assert re.fullmatch(r"fanfold: rank 0 of 2 stalled 5 s in DistributedDataParallel's all_reduce #\d+ \(bucket 0\) "
                        r"at train\.py:\d+: rank 1 never arrived \(behind, at all_reduce #\d+: did it skip a "
                        r"backward\?\)", lines[1]), lines
    assert lines[2] == "Traceback of rank 0:", lines
    end = next(i for i, line in enumerate(lines) if line.startswith("fanfold run: ") and i > 0)
    block = lines[3:end]
    _check(block, _user_frame("train.py"), debug=debug)
    assert any(line.startswith("fanfold.collectives.protocol.StallError: rank 0 of 2: ") for line in block)
    if not debug:
        assert len(lines) <= 16, "\n".join(lines)  # the report, rank 1's one line, the exit code


@pytest.mark.timeout(TIMEOUT)
def test_a_dead_peer_reads_first_under_fanfold_run(tmp_path):
    # Rank 1's process ends mid-step with exit code 0, so that rank 0 is the one failure: the launcher stops the
    # survivors of a rank that died by a signal or an error before they can tell their side.
    lines = _run(tmp_path, CASE="exits")
    assert re.fullmatch(r"fanfold run: rank 0 \(local rank 0, pid \d+\) failed with exit code 1", lines[0]), lines
    assert re.fullmatch(r"fanfold: rank 0 of 2 failed in DistributedDataParallel's all_reduce #\d+ \(bucket 0\) at "
                        r"train\.py:\d+: rank 1 never arrived \(.*its process is gone\)", lines[1]), lines
    assert lines[2] == "Traceback of rank 0:", lines
    _check(lines[3:-1], _user_frame("train.py"))
    assert lines[-1] == "fanfold run: exit code 1" and len(lines) <= 16, "\n".join(lines)


def _skips_a_backward() -> None:
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = fanfold.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    for step in range(3):
        loss = model(torch.randn(8, 4)).sum()
        if dist.get_rank() == 1 and step == 1:
            continue
        loss.backward()  # <- the launched function's line
    if dist.get_rank() == 1:
        time.sleep(120)  # rank 1 alone: rank 0 waits in its last backward's all-reduce


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_skipped_backward_reads_first_under_fanfold_launch():
    here = __file__.removesuffix("c")  # the .py, never a cached .pyc
    number = next(i for i, line in enumerate(Path(here).read_text().splitlines(), 1)
                  if line.endswith("# <- the launched function's line"))
    frame = [f'  File "{here}", line {number}, in _skips_a_backward',
             "    loss.backward()  # <- the launched function's line"]
    for debug in (False, True):
        env = {"FANFOLD_STALL_TIMEOUT": "5", **({"FANFOLD_DEBUG": "1"} if debug else {})}
        with pytest.raises(fanfold.WorkerError) as e:
            fanfold.launch(_skips_a_backward, nprocs=2, timeout=TIMEOUT, env=env)
        lines = str(e.value).splitlines()
        assert e.value.rank == 0, lines
        assert re.fullmatch(r"fanfold: rank 0 of 2 stalled 5 s in DistributedDataParallel's all_reduce #\d+ "
                            r"\(bucket 0\) at test_diagnosis\.py:\d+: rank 1 never arrived \(behind, at all_reduce "
                            r"#\d+: did it skip a backward\?\)", lines[0]), lines
        end = next(i for i, line in enumerate(lines) if line.startswith("fanfold.launch: "))
        _check(lines[1:end], frame, debug=debug)


def test_the_cut_keeps_the_users_frames_and_torchs_between_them():
    import torch

    from fanfold.launcher.worker_shim import _Frames

    def frame(path: str) -> traceback.FrameSummary:
        return traceback.FrameSummary(path, 1, "f", line="x")

    tree = os.path.dirname(torch.__file__)
    shim, user, user2 = frame(f"{PACKAGE}/launcher/worker_shim.py"), frame("/u/train.py"), frame("/u/model.py")
    call, module, linear = frame(f"{tree}/_tensor.py"), frame(f"{tree}/nn/modules/module.py"), frame(f"{tree}/f.py")
    ours, ours2 = frame(f"{PACKAGE}/distributed/reducer.py"), frame(f"{PACKAGE}/collectives/stall.py")
    frames = _Frames()
    # an error out of fanfold: the user's call is the last frame, the torch frames that led in go too
    assert frames.cut([shim, user, call, ours, ours2], debug=False) == ([user], True)
    # an error in the user's module, called through fanfold's forward: torch's frames between the user's stay
    assert frames.cut([shim, user, module, ours, module, user2, linear], debug=False) == (
        [user, module, module, user2, linear], True)
    assert frames.cut([shim, user, linear], debug=False) == ([user, linear], False)  # nothing of fanfold's
    assert frames.cut([shim, ours, ours2], debug=False) == ([ours, ours2], False)  # no frame of the user's
    assert frames.cut([shim, user, call, ours], debug=True) == ([user, call, ours], False)  # the launcher's only
