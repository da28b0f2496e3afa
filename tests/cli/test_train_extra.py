"""`fanfold train` without its extra (scikit-learn, matplotlib: not fanfold's dependencies) refuses before starting a
worker, naming the extra to install, rather than failing in every worker with a traceback."""
import importlib.util

from fanfold.cli import main


def test_train_without_its_extra_names_it(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    assert main(["train", "--out", str(tmp_path / "run"), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "needs scikit-learn, which fanfold alone does not install: pip install 'fanfold[train]'" in err, err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
