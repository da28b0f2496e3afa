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
