"""`fanfold train --sync-bn`: the main job's CNN with a SyncBatchNorm after each convolution, 2 real worker
processes, one epoch: it trains (accuracy printed, well above chance), the checkpoint holds the BatchNorm layers'
running statistics updated once per step, and they load into the plain model with BatchNorm."""
import json
import subprocess
import sys

import pytest
import torch

import fanfold
from fanfold import cli
from fanfold.training import job as train

pytestmark = pytest.mark.timeout(600)


def test_train_with_sync_bn(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "fanfold", "train", "--devices", "2", "--epochs", "1",
                           "--sync-bn", "--out", str(out)], capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "test accuracy:" in proc.stdout
    assert json.loads((out / "metrics.json").read_text())["test_accuracy"] > 0.5  # 10 classes: chance is 0.1
    model = train.make_model(batch_norm=True)
    saved = fanfold.load(out / train.CHECKPOINT, {"model": model, "step": 0, "run": {}}, rng=False)
    assert saved["run"]["sync_bn"] is True
    steps = saved["step"]
    assert steps == 23  # 1440 digits / global batch 64
    for name in ("1", "4"):  # the BatchNorm2d after each convolution
        bn = model.get_submodule(name)
        assert bn.num_batches_tracked.item() == steps
        assert not torch.equal(bn.running_var, torch.ones_like(bn.running_var))
    assert len(train.make_model().state_dict()) == len(model.state_dict()) - 2 * 5  # default: no BatchNorm


def test_sync_bn_is_a_run_setting(tmp_path, capsys):
    """A checkpoint written before --sync-bn existed (no "sync_bn" in its settings) still reads, as a run without
    it; resuming it with --sync-bn is refused by the parent, as any changed setting is."""
    old = {"epochs": 2, "batch_size": 64, "lr": 0.01, "seed": 3}
    fanfold.save(tmp_path / train.CHECKPOINT, {"step": 5, "run": old})
    assert train.saved_settings(tmp_path / train.CHECKPOINT) == old
    assert cli.main(["train", "--out", str(tmp_path), "--resume", "--sync-bn"]) == 2
    err = capsys.readouterr().err
    assert "was trained with no --sync-bn; --sync-bn would not continue that run" in err, err
    fanfold.save(tmp_path / "b.pt", {"run": {**old, "sync_bn": True}})
    assert train.saved_settings(tmp_path / "b.pt") == {**old, "sync_bn": True}
    fanfold.save(tmp_path / "c.pt", {"run": {**old, "colour": "red"}})
    with pytest.raises(ValueError, match="holds no run settings"):
        train.saved_settings(tmp_path / "c.pt")
