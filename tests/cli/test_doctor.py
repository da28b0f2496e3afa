"""`fanfold doctor`: the facts it prints are this machine's (checked against torch and os directly), the worker
probe really runs, and a missing requirement makes it exit 1 naming what is missing."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from fanfold import cli


def _lines(text: str) -> dict[str, str]:
    return {m[1]: m[2] for m in re.finditer(r"^(\S+(?: collectives| reads)?)\s{2,}(.*)$", text, re.M)}


def test_facts_without_the_probe(capsys):
    assert cli.main(["doctor", "--no-probe"]) == 0
    out = capsys.readouterr().out
    lines = _lines(out)
    assert lines["torch"].startswith(torch.__version__)
    assert lines["CPUs"].startswith(f"{len(os.sched_getaffinity(0))} usable by this process of {os.cpu_count()}")
    assert f"gloo: {'yes' if dist.is_gloo_available() else 'no'}" in lines["backends"]
    assert lines["workers"] == "not probed (--no-probe)"
    assert ("/dev/shm" in lines) and ("shm collectives" not in lines)
    assert out.splitlines()[-1] == "fanfold doctor: everything fanfold needs is here"


def test_missing_gloo_exits_1_and_says_so(capsys, monkeypatch):
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    assert cli.main(["doctor"]) == 1  # no probe either: it would need gloo
    out = capsys.readouterr().out
    assert "gloo: no" in out and _lines(out)["workers"] == "not probed"
    assert out.splitlines()[-1] == "fanfold doctor: missing: the gloo backend (CPU process groups)"


@pytest.mark.timeout(240)
def test_probe_with_two_real_workers():
    res = subprocess.run([sys.executable, "-m", "fanfold", "doctor", "--timeout", "180"], capture_output=True,
                         text=True, timeout=230)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = _lines(res.stdout)
    assert lines["workers"] == "2 local gloo workers: started, all-reduced"
    # Either it works, or the doctor says why not: never a bare "no".
    assert lines["shm collectives"].startswith(("work: 2 ranks summed through /dev/shm", "do not work here: "))
    assert lines["peer reads"].startswith(("work: ", "not available: ", "not probed"))
    if lines["peer reads"].startswith("not available"):
        assert "ptrace" in lines["peer reads"] or "seccomp" in lines["peer reads"] or "Linux" in lines["peer reads"]
