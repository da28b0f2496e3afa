"""docs/migrating.md's claims, checked against torch: state_dict keys and named_parameters of the wrappers, and
loading a checkpoint written from torch's DataParallel (``module.`` keys) without the lossy split loop."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fanfold
from fanfold.training.checkpoint import unwrap_state_dict


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Module()
    net.fc1, net.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)
    return net


def test_wrapper_keys_are_the_modules_own_but_named_parameters_say_module():
    net = _net()
    dp = fanfold.DataParallel(net, device_ids=["cpu", "cpu"])
    assert list(dp.state_dict()) == list(net.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert [n for n, _ in dp.named_parameters()] == [n for n, _ in nn.DataParallel(net).named_parameters()]
    assert next(iter(dp.named_parameters()))[0] == "module.fc1.weight"
    assert list(nn.DataParallel(net).state_dict())[0] == "module.fc1.weight"  # torch's wrapper: prefixed


def test_old_prefixed_checkpoint_loads(tmp_path):
    src = _net()
    path = tmp_path / "old.pt"
    torch.save(nn.DataParallel(src).state_dict(), path)  # as torch users saved them: module.fc1.weight, ...
    saved = torch.load(path)
    # The notes' loop strips the first name of every key: right for torch's file, but on fanfold's unprefixed
    # keys both layers' weights become "weight". unwrap_state_dict / fanfold.load strip wrapper prefixes only.
    ours = fanfold.DataParallel(src, device_ids=["cpu"]).state_dict()
    lossy = {".".join(k.split(".")[1:]): v for k, v in ours.items()}
    assert sorted(lossy) == ["bias", "weight"]
    assert list(unwrap_state_dict(src.state_dict())) == list(src.state_dict())
    target = nn.Module()
    target.fc1, target.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)
    fanfold.load(path, {"model": target}, rng=False)
    for (name, a), b in zip(src.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name
    other = nn.Module()
    other.fc1, other.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)
    other.load_state_dict(unwrap_state_dict(saved))
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), other.state_dict().values()))
    with pytest.raises(RuntimeError, match="Missing key"):  # torch's own load of the prefixed file fails
        nn.Module.load_state_dict(_net(), saved)


def test_the_cpu_replacement_for_the_tutorials_cuda_guard_runs_as_written():
    # docs/migrating.md: the tutorials' `if torch.cuda.device_count() > 1` guard and `.cuda(id)` calls, replaced
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "migrating.md").read_text()
    assert "if torch.cuda.device_count() > 1:" in text and ".cuda(0)" in text
    block = next(b for b in re.findall(r"^```\n(.*?)^```$", text, re.M | re.S) if b.startswith("device_ids = "))
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(6, 3)
    expected = model(x)  # the bare module on the whole batch: the oracle
    scope = {"torch": torch, "fanfold": fanfold, "model": model, "x": x}
    exec(block, scope)
    assert isinstance(scope["model"], fanfold.DataParallel)
    if not torch.cuda.is_available():
        assert scope["model"].device_ids == [torch.device("cpu")] * 2
    torch.testing.assert_close(scope["model"](scope["x"]).cpu(), expected)
