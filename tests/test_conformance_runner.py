"""The `make conformance` machinery (conformance/), without the slow suite: the selection rule on a made-up suite
and on torch's, the patching checked from inside a real rank process, and the report's error extraction."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "conformance"


def _load(name: str):
    sys.path.insert(0, str(TOOL))  # the tool's modules import each other by plain name, as when run as scripts
    try:
        spec = importlib.util.spec_from_file_location(f"conformance_{name}", TOOL / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(TOOL))


FAKE_SUITE = textwrap.dedent('''
    class DistributedTest:
        class _DistTestBase:
            def _build(self):
                return nn.parallel.DistributedDataParallel(self._net())

            def _indirect(self):
                return self._build()

            def _net(self):
                return "DistributedDataParallel( in a string is no call"

            def test_ddp_by_name(self):
                pass

            def test_DistributedDataParallel_by_name(self):
                pass

            def test_direct_call(self):
                DistributedDataParallel(model)

            def test_through_two_helpers(self):
                self._indirect()

            def test_string_only(self):
                self._net()

            def test_all_reduce(self):
                dist.all_reduce(t)

    class Other:
        def test_ddp_elsewhere(self):
            pass
''')


def test_selection_rule_on_a_made_up_suite(tmp_path):
    path = tmp_path / "distributed_test.py"
    path.write_text(FAKE_SUITE)
    assert _load("selection").ddp_tests(path) == [
        "test_DistributedDataParallel_by_name", "test_ddp_by_name", "test_direct_call", "test_through_two_helpers"]


def test_selection_on_torchs_suite_takes_ddp_tests_only():
    selected = _load("selection").ddp_tests()
    assert {"test_DistributedDataParallelCPU", "test_ddp_create_graph", "test_accumulate_gradients_no_sync",
            "test_static_graph_api_cpu"} <= set(selected)
    assert not {"test_all_reduce_sum", "test_broadcast", "test_barrier"} & set(selected)
    assert all(n.startswith("test_") for n in selected) and selected == sorted(set(selected))


def test_rank_processes_see_fanfolds_class(tmp_path):
    """SelfCheck runs inside each of 2 gloo ranks: every patched name is fanfold's class, nothing in torch.nn or
    torch.testing still names torch's, and one step through the name averages gradients like the whole batch."""
    results = tmp_path / "results.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, str(TOOL / "driver.py"), "--ddp", "fanfold", "--results", str(results), "--timeout", "60",
         "SelfCheck.test_ddp_names_in_rank"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, start_new_session=True)
    records = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    outcome = [r for r in records if "status" in r]
    assert proc.returncode == 0 and len(outcome) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert outcome[0]["test"] == "SelfCheck.test_ddp_names_in_rank"
    assert outcome[0]["status"] == "pass", outcome[0]["detail"]


FAKE_DRIVER = textwrap.dedent('''
    """Stands in for driver.py: "hang" starts a grandchild and sleeps, "crash" exits, any other test passes."""
    import argparse, json, os, subprocess, sys, time
    p = argparse.ArgumentParser()
    for flag in ("--ddp", "--results", "--timeout", "--start-method"):
        p.add_argument(flag)
    p.add_argument("tests", nargs="+")
    args = p.parse_args()
    def write(record):
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\\n")
    for test in args.tests:
        write({"test": test, "event": "start"})
        if test == "hang":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open(os.environ["FAKE_PID_FILE"], "w").write(str(child.pid))
            time.sleep(600)
        if test == "crash":
            print("dying now", flush=True)
            os._exit(3)
        write({"test": test, "status": "pass", "seconds": 0.0, "detail": ""})
''')


def test_runner_bounds_a_hanging_test_survives_a_crash_and_leaves_no_process(tmp_path, monkeypatch):
    run = _load("run")
    driver = tmp_path / "fake_driver.py"
    driver.write_text(FAKE_DRIVER)
    monkeypatch.setenv("FAKE_PID_FILE", str(tmp_path / "pid"))
    outcomes = run.run_tests("fanfold", ["a", "hang", "crash", "b"], tmp_path / "fanfold", timeout=1,
                             start_method="spawn", driver=driver, grace=1)
    assert {n: o.status for n, o in outcomes.items()} == {"a": "pass", "hang": "timeout", "crash": "fail", "b": "pass"}
    assert "killed by the runner" in outcomes["hang"].detail
    assert "exited with 3" in outcomes["crash"].detail and "dying now" in outcomes["crash"].detail
    grandchild = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed with the driver's process group, and reaped by init
        for _ in range(50):
            os.kill(grandchild, 0)
            time.sleep(0.1)
    recorded = [json.loads(line) for line in (tmp_path / "fanfold.jsonl").read_text().splitlines()]
    assert [r["test"] for r in recorded if "status" in r] == ["a", "hang", "crash", "b"]


HARNESS_REPORT = """Traceback (most recent call last):
  File "common_distributed.py", line 1213, in _check_return_codes
    raise RuntimeError(error)
RuntimeError: Process 0 exited with error code 10 and exception:
Traceback (most recent call last):
  File "x.py", line 1, in f
ValueError: the root cause

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
fanfold.distributed.stall.StallError: rank 0 of 2: all_reduce #3
  cause: ValueError: indented lines are not exceptions

Process 1 exited with error code 10 and exception:
Traceback (most recent call last):
AssertionError: RuntimeError not raised by <lambda>
"""


@pytest.mark.parametrize("detail, expected", [
    (HARNESS_REPORT, ["ValueError: the root cause -> fanfold.distributed.stall.StallError: rank 0 of 2: all_reduce #3",
                      "AssertionError: RuntimeError not raised by <lambda>"]),
    ("Traceback (most recent call last):\nRuntimeError: Process 0 terminated or timed out after 150.1 seconds\n",
     ["RuntimeError: Process 0 terminated or timed out after 150.1 seconds"]),
])
def test_report_names_each_ranks_error(detail, expected):
    assert _load("report").error_lines(detail) == expected


CUDA_ON_CPU_CHECK = textwrap.dedent('''
    import os, sys
    os.environ.update(BACKEND="gloo", WORLD_SIZE="2")
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed import distributed_test
    from cuda_on_cpu import install
    install(DistributedDataParallel, world_size=2)
    suite = distributed_test.torch.cuda
    assert suite.is_available() and suite.device_count() == 8 and common_distributed.TEST_CUDA
    assert common_distributed.torch.cuda is suite
    assert not torch.cuda.is_available(), "torch itself must stay honest"
    suite.set_device(1)
    assert suite.current_device() == 1
    x = torch.ones(3)
    for moved in (torch.randn(2, device=1), torch.zeros(2, device="cuda:1"), x.cuda(1), x.to("cuda"), x.to(0),
                  x.to(torch.device("cuda", 1), torch.float64), x.new_zeros(2, device=0),
                  torch.nn.Linear(2, 2).cuda(1).weight, torch.nn.Linear(2, 2).to(1).weight):
        assert moved.device.type == "cpu", moved
    assert x.to(torch.float64).dtype == torch.float64
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    model = torch.nn.Linear(2, 1)
    ddp = DistributedDataParallel(model, device_ids=[0], output_device=0)
    ddp(torch.ones(4, 2, device=0)).sum().backward()
    torch.testing.assert_close(model.weight.grad, torch.full((1, 2), 4.0))
    dist.destroy_process_group()
    print("mapped")
''')


def test_cuda_on_cpu_maps_the_suites_devices_and_leaves_torch_honest(tmp_path):
    """The CPU port's mapping in a fresh process: the suite sees 8 CUDA devices, torch sees none, every CUDA
    placement lands on the CPU, and torch's DDP accepts device_ids for a CPU module (one gloo rank, whole batch)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TOOL), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", CUDA_ON_CPU_CHECK, str(tmp_path / "store")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "mapped" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_cuda_on_cpu_runs_a_gpu_test_and_skips_a_cuda_one(tmp_path):
    """Through driver.py --cuda-on-cpu with fanfold's DDP in 2 gloo ranks: a test torch's suite skips without 2 GPUs
    runs and passes; a test of CUDA itself is skipped with its reason from reasons.CUDA_ONLY."""
    results = tmp_path / "results.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, str(TOOL / "driver.py"), "--ddp", "fanfold", "--cuda-on-cpu", "--results", str(results),
         "--timeout", "60", "test_ddp_broadcast_buffer", "test_ddp_device"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, start_new_session=True)
    records = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    outcome = {r["test"]: r for r in records if "status" in r}
    assert proc.returncode == 0 and len(outcome) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert outcome["test_ddp_broadcast_buffer"]["status"] == "pass", outcome["test_ddp_broadcast_buffer"]["detail"]
    assert outcome["test_ddp_device"]["status"] == "skip"
    assert outcome["test_ddp_device"]["detail"].startswith("CUDA itself: CUDA placement")


def test_port_section_counts_the_cuda_tests_only():
    """The CPU port's counts are over the tests the plain run skipped for want of CUDA; torch's own skips and the
    CPU tests are named apart; a test torch passes and fanfold fails is listed as a difference."""
    report = _load("report")
    o = report.Outcome
    plain = {"cpu": o("cpu", "pass", 1, ""), "gpu": o("gpu", "skip", 0, "Need at least 2 CUDA devices"),
             "gpu2": o("gpu2", "skip", 0, "CUDA is not available."), "own": o("own", "skip", 0, "https://x/1")}
    port = {"torch": {"cpu": o("cpu", "pass", 1, ""), "gpu": o("gpu", "pass", 1, ""),
                      "gpu2": o("gpu2", "pass", 1, ""), "own": o("own", "skip", 0, "https://x/1")},
            "fanfold": {"cpu": o("cpu", "pass", 1, ""), "gpu": o("gpu", "pass", 1, ""),
                        "gpu2": o("gpu2", "fail", 1, "Traceback\nValueError: boom\n"),
                        "own": o("own", "skip", 0, "https://x/1")}}
    meta = {"command": "c", "started": "s", "tests": ["cpu", "gpu", "gpu2", "own"], "seconds": {}, "revision": "r"}
    text = "\n".join(report.port_lines(meta, port, plain))
    assert "Of the 2 tests the run above skips for want of CUDA, **2 run on the port**" in text
    assert "the other 1 skips of the run above are torch's own" in text
    assert "| torch's DDP | 2 | 0 | 0 | 0 |" in text and "| fanfold's DDP | 1 | 1 | 0 | 0 |" in text
    assert "**Of the 2 that pass with torch's DDP, 1 pass with fanfold's.**" in text
    assert "| `gpu2` | pass | **FAIL** | not investigated yet: ValueError: boom |" in text
