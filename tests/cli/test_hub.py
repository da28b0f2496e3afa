"""The `fanfold` hub's wording: errors name the flag the user typed, never an internal function; `--version`;
every option has help text and shows its default; no progress-bar fragments when the output is not a terminal."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import fanfold
from fanfold import cli


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_run_errors_name_what_the_user_typed(capsys, tmp_path):
    assert _error(capsys, ["run"]) == "fanfold run: error: no script given: fanfold run [options] SCRIPT [ARGS...]"
    assert _error(capsys, ["run", "-n", "0", "x.py"]) == "fanfold run: error: -n/--nproc-per-node must be >= 1, got 0"
    assert _error(capsys, ["run", "--max-restarts", "-1", "x.py"]) == (
        "fanfold run: error: --max-restarts must be >= 0, got -1")
    missing = str(tmp_path / "missing.py")
    assert _error(capsys, ["run", "-n", "1", missing]) == f"fanfold run: error: script not found: {missing!r}"
    script = tmp_path / "s.py"
    script.write_text("")
    assert _error(capsys, ["run", "--nnodes", "2:1", str(script)]) == (
        "fanfold run: error: --nnodes must satisfy 0 < MIN <= MAX, got '2:1'")
    assert _error(capsys, ["run", "--nnodes", "2", str(script)]).endswith("pass --rdzv-endpoint as HOST:PORT")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"fanfold {fanfold.__version__}"


def test_every_option_has_help_and_its_default():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"demo", "run", "train"}
    for name, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"fanfold {name}: {action.option_strings or action.dest} has no help text"
            shown = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
            if shown:  # an explicit default: the help shows it (argparse's wrap may break the line)
                flat = " ".join(text.split())
                assert f"(default: {action.default})" in flat, f"fanfold {name} {action.option_strings[0]}"


def test_demo_to_a_pipe_has_no_progress_bar_fragments():
    res = subprocess.run([sys.executable, "-m", "fanfold", "demo", "--devices", "2"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "0%|" not in res.stdout + res.stderr and "\r" not in res.stdout + res.stderr
    assert res.stderr == ""
    assert res.stdout.splitlines()[0] == "Let's use 2 device(s): cpu, cpu"
    assert sum(ln.startswith("Outside:") for ln in res.stdout.splitlines()) == 4
