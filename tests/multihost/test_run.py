"""``fanfold run --nnodes 2`` across simulated hosts: one agent per host, torch's c10d rendezvous on host 0, 2
workers each. A worker killed on host 1 makes both agents restart their workers (``--max-restarts 1``), which
resume from the checkpoint; the final parameters are bitwise those of the same run without the kill."""
from __future__ import annotations

import os
import subprocess
import sys

import torch
from hosts import Hosts

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_resume.py")
STEPS = 6


def _run(tmp_path, name: str, *script_args: str) -> tuple[list[torch.Tensor], list[str]]:
    out = tmp_path / name
    out.mkdir()
    with Hosts(2) as hosts:
        endpoint = f"{hosts.addr(0)}:29400"
        agents = []
        for h in range(2):
            argv = [sys.executable, "-m", "fanfold", "run", "--nnodes", "2", "--node-rank", str(h), "-n", "2",
                    "--rdzv-endpoint", endpoint, "--rdzv-id", name, "--max-restarts", "1", "--rank-prefix",
                    SCRIPT, str(out), str(STEPS), *script_args]
            agents.append(hosts.popen(h, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = []
        for h, agent in enumerate(agents):
            try:
                logs.append(agent.communicate(timeout=300)[0])
            except subprocess.TimeoutExpired:
                agent.kill()
                logs.append(agent.communicate()[0] + "\n(timed out)")
        codes = [agent.returncode for agent in agents]
        assert codes == [0, 0], f"the agents' exit codes: {codes}\n" + "\n".join(
            f"--- host {h}:\n{log}" for h, log in enumerate(logs))
    return torch.load(out / "final.pt"), logs


def test_run_two_nodes_restart_resumes_bitwise(tmp_path):
    want, logs = _run(tmp_path, "whole")
    for h in range(2):
        assert f"on h{h}: attempt 0, from step 0" in logs[h], logs[h]
    got, logs = _run(tmp_path, "killed", "--kill-at", "3")
    assert "rank 3 of 4 on h1: attempt 0, from step 0" in logs[1], logs[1]
    assert "killed by signal SIGKILL; restarting (attempt 1 of 1)" in logs[1], logs[1]
    # both hosts' workers restarted and resumed after the 3 checkpointed steps (host 0's agent may count the
    # restart as a membership change: its TORCHELASTIC_RESTART_COUNT can stay 0)
    assert "on h1: attempt 1, from step 3" in logs[1], logs[1]
    assert logs[0].count("of 4 on h0: attempt ") == 4 and logs[0].count(", from step 3") == 2, logs[0]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"parameter {i} differs after the restart"
