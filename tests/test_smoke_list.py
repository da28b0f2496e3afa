"""The smoke test (tests/smoke/smoke.py, run by `make smoke` in a fresh venv) covers every public name and every
subcommand: a name added to ``fanfold.__all__`` or a command added to the CLI without a smoke check fails here."""
import importlib.util
from pathlib import Path

import fanfold
from fanfold.cli import _COMMANDS, build_parser

SMOKE = Path(__file__).resolve().parent / "smoke" / "smoke.py"


def _smoke():
    spec = importlib.util.spec_from_file_location("fanfold_smoke", SMOKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the checks only: main() runs under __main__
    return module


def test_every_public_name_has_one_smoke_check():
    smoke = _smoke()
    assert not set(smoke.LOCAL) & set(smoke.RANKED)
    assert set(smoke.LOCAL) | set(smoke.RANKED) == set(fanfold.__all__)


def test_every_subcommand_has_a_smoke_check():
    registered = set(build_parser()._subparsers._group_actions[0].choices)
    assert registered == set(_COMMANDS)
    assert set(_smoke().COMMANDS) == registered
