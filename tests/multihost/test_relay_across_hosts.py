"""A relay between the ranks of a multi-node ``fanfold run`` and the job's store, on the simulated hosts: an
attacker on host 1 (``relay_attack.py``; its relay runs as user `nobody`) rewrites the job store's address in the
workers' open store with its relay's, which forwards each connection to the real store. With a job secret on both
nodes, the ranks that connect through it finish the job as through a pipe, and the relay's log holds none of the
job's keys or values, nor the secret; the open store itself holds none either. Positive control: the same attacker
against the same job without a secret reads every rank's values from the open store."""
from __future__ import annotations

import json
import os
import pwd
import secrets
import subprocess
import sys

from hosts import Hosts

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the relay
from _relay import runner  # noqa: E402

JOB = os.path.join(HERE, "relay_job.py")
ATTACK = os.path.join(HERE, "relay_attack.py")
WORLD = 4


def _attacked_run(out: str, canary: str, secret: str | None) -> dict:
    """The job on 2 hosts x 2 ranks with the attacker on host 1; every rank's report and the attacker's."""
    os.makedirs(out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FANFOLD_JOB_SECRET")}
    if secret is not None:
        env["FANFOLD_JOB_SECRET"] = secret
    with Hosts(2) as hosts:
        attacker = hosts.popen(1, [sys.executable, ATTACK, out, hosts.addr(1)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        agents = [hosts.popen(h, [sys.executable, "-m", "fanfold", "run", "--nnodes", "2", "--node-rank", str(h),
                                  "-n", "2", "--rdzv-endpoint", f"{hosts.addr(0)}:29400", "--rdzv-id", "relay",
                                  JOB, out, canary], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for h in range(2)]
        logs = []
        for agent in agents:
            try:
                logs.append(agent.communicate(timeout=240)[0])
            except subprocess.TimeoutExpired:
                agent.kill()
                logs.append(agent.communicate()[0] + "\n(timed out)")
        open(os.path.join(out, "done"), "w").close()
        try:
            attack_log = attacker.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            attacker.kill()
            attack_log = attacker.communicate()[0] + "\n(timed out)"
    text = "\n".join(f"--- host {h}:\n{log}" for h, log in enumerate(logs)) + f"\n--- attacker:\n{attack_log}"
    assert [a.returncode for a in agents] == [0, 0], text
    assert attacker.returncode == 0, text
    ranks = []
    for r in range(WORLD):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    with open(os.path.join(out, "attack.json")) as f:
        attack = json.load(f)
    return {"ranks": ranks, "attack": attack, "text": text}


def test_a_relay_on_another_host_carries_a_multinode_job_and_reads_nothing(tmp_path):
    secret, canary = secrets.token_hex(32), f"canary-{secrets.token_hex(8)}"
    run = _attacked_run(str(tmp_path / "secret"), canary, secret)
    for rank in run["ranks"]:  # the job is right: every rank read every canary, the all-reduce summed 1..4
        assert rank["read"] == [f"{canary}-{r}" for r in range(WORLD)] and rank["sum"] == 10.0, run["text"]
    attack = run["attack"]
    assert attack["real"] is not None, f"rank 0 never published the job store's address\n{run['text']}"
    assert attack["connections"] >= 1, f"no rank connected through the relay: the test tried nothing\n{attack}"
    if not runner()[2]:
        assert attack["uid"] == pwd.getpwnam("nobody").pw_uid
    seen = bytes.fromhex(attack["seen"])
    assert len(seen) > 200, attack  # the relay did carry the traffic
    for plain in (canary, "canary/rank", secret):
        assert plain.encode() not in seen, f"the relay read {plain!r}"
    assert attack["canaries"] == {}, attack  # the open store holds only the job store's address

    control = _attacked_run(str(tmp_path / "open"), canary, None)
    assert control["attack"]["canaries"] == {str(r): f"{canary}-{r}" for r in range(WORLD)}, control["attack"]
