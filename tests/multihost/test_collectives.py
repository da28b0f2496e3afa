"""Collectives and DDP across simulated hosts (``hosts.py``: namespaces, a veth link): 2 hosts x 2 ranks, 2 x 1 and
an uneven 1 + 2. Every collective through the ``fanfold`` backend and fanfold's own transports against a gloo group
over the same ranks; fanfold's DDP and torch's DDP over the ``fanfold`` backend against one process on the whole
batch. The results are asserted, not the path taken (flat gloo or hierarchical), except in
``test_hierarchical_bytes``."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from hosts import Hosts, wait_ranks

from _ddp_models import batch, loss_fn, mlp, optimizer

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
LAYOUTS = {"2x2": [2, 2], "2x1": [1, 1], "1+2": [1, 2]}
ROUTES = ("backend", "own(backend)", "own(gloo)")


def run_job(tmp_path, layout, *args, link=None, timeout=240.0) -> list[dict]:
    """Run ``worker.py`` ``args`` as the ranks of ``layout`` (ranks per host); every rank's result."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    with Hosts(len(layout), link=link) as hosts:
        ranks = hosts.start_ranks(layout, [sys.executable, WORKER, *args[:1], str(out), *args[1:]], str(tmp_path))
        wait_ranks(ranks, timeout)
    return [torch.load(out / f"rank{r}.pt") for r in range(sum(layout))]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_collective_against_gloo(tmp_path, layout):
    results = run_job(tmp_path, layout, "collectives")
    world = sum(layout)
    names = [r["hostname"] for r in results]
    assert names == [f"h{h}" for h, k in enumerate(layout) for _ in range(k)], names
    for res in results:
        oracle = res["gloo"]
        for route in ROUTES:
            got = res[route]
            assert set(got) == set(oracle), (route, set(oracle) ^ set(got))
            for key, want in oracle.items():
                if key == "barrier_wait_s":
                    continue
                exact = not want.dtype.is_floating_point or key.startswith(("broadcast", "all_gather"))
                torch.testing.assert_close(got[key], want, rtol=0 if exact else None, atol=0 if exact else None,
                                           msg=lambda m, r=res["rank"], k=key, ro=route: f"rank {r}, {ro}, {k}: {m}")
    for route in ("gloo", *ROUTES):
        for key in results[0][route]:
            if key.startswith("all_reduce") and route != "gloo":  # every rank the same bits (the oracle's too)
                for res in results[1:]:
                    assert torch.equal(res[route][key], results[0][route][key]), (route, key, res["rank"])
        # the last rank arrived 1 s late at each barrier: everyone else waited for it
        waits = [res[route]["barrier_wait_s"] for res in results[:-1]]
        assert min(waits) > 0.7, (route, waits)
    assert world == len(results)


def _oracle(steps: int, n: int) -> list[torch.Tensor]:
    model = mlp()
    opt = optimizer(model)
    for step in range(steps):
        x, y = batch("mlp", step, n)
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("layout, which", [
    (LAYOUTS["2x2"], "fanfold"), (LAYOUTS["1+2"], "fanfold"), (LAYOUTS["2x2"], "torch"), (LAYOUTS["1+2"], "torch"),
    (LAYOUTS["2x2"], "fsdp2"), (LAYOUTS["1+2"], "fsdp2"), (LAYOUTS["2x2"], "hsdp"),
], ids=["2x2-fanfold DDP over gloo", "1+2-fanfold DDP over gloo", "2x2-torch DDP over fanfold",
        "1+2-torch DDP over fanfold", "2x2-FSDP2 over fanfold", "1+2-FSDP2 over fanfold", "2x2-HSDP over fanfold"])
def test_ddp_against_one_process(tmp_path, layout, which):
    results = run_job(tmp_path, layout, "ddp", which)
    if which in ("torch", "fsdp2"):  # the whole group spans the hosts: the hierarchical path
        assert all(r["transport"] == "HierarchicalTransport" for r in results), [r["transport"] for r in results]
    if which == "hsdp":  # the shard dimension is one host's ranks: shared memory; replicate: one rank per host, gloo
        assert all(r["mesh groups"] == ["ShmTransport", "NoneType"] for r in results), results[0]["mesh groups"]
    want = _oracle(3, 12)  # worker.STEPS, worker.GLOBAL_BATCH
    for res in results:
        assert len(res["params"]) == len(want)
        for i, (got, ref) in enumerate(zip(res["params"], want)):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=lambda m, r=res["rank"], i=i:
                                       f"rank {r}, parameter {i}: {m}")
    for res in results[1:]:  # replicas stay identical
        assert all(torch.equal(a, b) for a, b in zip(res["params"], results[0]["params"])), res["rank"]


def _link_bytes(tmp_path, backend: str, mib: int) -> tuple[int, int, int]:
    results = run_job(tmp_path, LAYOUTS["2x2"], "tx_bytes", backend, str(mib))
    assert all(r["correct"] for r in results)
    return results[0]["tx"], results[0]["tx_reduce_scatter"], results[0]["bytes"]


def test_flat_ring_bytes_on_the_link(tmp_path):
    """The harness's counters see the cross-host traffic: gloo's ring all_reduce over 2 x 2 ranks sends
    2S(HL-1)/(HL) = 1.5 S out of host 0 (within 10%); the hops inside a host do not cross the link."""
    tx, _, size = _link_bytes(tmp_path, "gloo", 16)
    assert abs(tx - 1.5 * size) < 0.1 * 1.5 * size, (tx, size)


def test_hierarchical_bytes(tmp_path):
    """The one test of the path taken: through the ``fanfold`` backend over 2 x 2 ranks, an all_reduce sends
    2S(H-1)/H = S bytes out of host 0 and a reduce_scatter S(H-1)/H = S / 2 (within 10%), not the flat ring's
    1.5 S."""
    tx, tx_rs, size = _link_bytes(tmp_path, "fanfold", 16)
    assert abs(tx - size) < 0.1 * size, (tx, size)
    assert abs(tx_rs - size / 2) < 0.1 * size / 2, (tx_rs, size)
