"""What ``import fanfold`` loads, against what ``import torch`` loads, each in a fresh interpreter: torch's heavy
optional parts (dynamo and the compiler stack, the elastic agent, FSDP, DTensor) stay unloaded until a feature that
needs them is used, and then they load and the feature works. How long the imports take is the benchmark's job
(benchmarks/import_cost.py); here only which modules are loaded."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Each a few hundred milliseconds to seconds of import on a laptop; none needed by a plain import of fanfold.
HEAVY = ["torch._dynamo", "torch._inductor", "torch.distributed.elastic", "torch.distributed.launcher",
         "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed._functional_collectives",
         "torch.fx.experimental.symbolic_shapes", "torch.onnx", "sympy"]


def _fresh(code: str, tmp_path: Path, timeout: float = 240) -> dict:
    """Run ``code`` in a fresh interpreter with this tree's fanfold; the JSON its last line prints."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict[str, list[str]]:
    """The modules each of ``import torch`` and ``import fanfold`` leaves in ``sys.modules``."""
    tmp = tmp_path_factory.mktemp("imports")
    code = "import json, sys\nimport {}\nprint(json.dumps(sorted(sys.modules)))"
    return {name: _fresh(code.format(name), tmp) for name in ("torch", "fanfold")}


def test_fanfold_is_imported_from_this_tree(tmp_path):
    assert _fresh("import fanfold, json; print(json.dumps(fanfold.__file__))", tmp_path).startswith(str(SRC))


@pytest.mark.parametrize("module", HEAVY)
def test_import_fanfold_does_not_load(module, loaded):
    assert module not in loaded["torch"], f"`import torch` itself loads {module}: this check no longer tells"
    assert module not in loaded["fanfold"], f"`import fanfold` loads {module}"


def test_import_fanfold_loads_no_torch_module_that_import_torch_does_not(loaded):
    extra = sorted(m for m in set(loaded["fanfold"]) - set(loaded["torch"]) if m.split(".")[0] == "torch")
    assert not extra, f"`import fanfold` loads torch modules that `import torch` does not: {extra}"


def test_public_names_resolve_without_heavy_modules(tmp_path):
    got = _fresh(f"HEAVY = {HEAVY!r}\n" + textwrap.dedent("""
        import json, sys
        import fanfold
        from fanfold import *  # noqa: F403
        missing = [n for n in fanfold.__all__ if not hasattr(fanfold, n)]
        print(json.dumps({"missing": missing, "heavy": [m for m in HEAVY if m in sys.modules]}))
    """), tmp_path)
    assert got == {"missing": [], "heavy": []}


def test_compiled_ddp_loads_dynamo_and_matches_torch(tmp_path):
    # One rank: fanfold's DDP under torch.compile against the plain module (with one rank DDP's averaged gradient
    # is the rank's own). Dynamo is loaded by compiling, and fanfold's forward bookkeeping then runs outside the
    # graph through the torch.compiler.disable function imported at that moment.
    got = _fresh("""
        import json, sys
        import torch
        import torch.distributed as dist
        from torch import nn
        import fanfold

        before = "torch._dynamo" in sys.modules
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double()
        ours = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double()
        ours.load_state_dict(plain.state_dict())
        model = torch.compile(fanfold.DDP(ours), backend="eager")
        worst = 0.0
        for step in range(2):
            x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            for m in (plain, model):
                m.zero_grad()
                m(x).pow(2).sum().backward()
            for a, b in zip(plain.parameters(), ours.parameters()):
                worst = max(worst, (a.grad - b.grad).abs().max().item())
        dist.destroy_process_group()
        print(json.dumps({"before": before, "after": "torch._dynamo" in sys.modules,
                          "outside_graph": "fanfold._core._disabled" in sys.modules, "worst": worst}))
    """, tmp_path)
    assert got["before"] is False, "torch._dynamo was loaded before torch.compile was called"
    assert got["after"] and got["outside_graph"], got
    assert got["worst"] < 1e-12, got


def test_launch_script_loads_torch_elastic_and_runs(tmp_path):
    # the script records its rank and world as torchrun's environment gives them
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os, pathlib
        pathlib.Path(f"rank{os.environ['RANK']}").write_text(os.environ["WORLD_SIZE"])
    """))
    got = _fresh("""
        import json, sys
        import fanfold
        before = "torch.distributed.elastic" in sys.modules
        code = fanfold.launch_script(["job.py"], nproc_per_node=2)
        print(json.dumps({"before": before, "after": "torch.distributed.elastic" in sys.modules, "code": code}))
    """, tmp_path)
    assert got == {"before": False, "after": True, "code": 0}
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["2", "2"]
