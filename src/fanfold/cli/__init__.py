"""The ``fanfold`` command: an argparse hub that only dispatches. Each subcommand is a module ``fanfold.cli.<name>``
with ``add_arguments(parser)`` and ``main(args) -> int``."""
from __future__ import annotations

import argparse
import importlib

_COMMANDS = {
    "demo": ("fanfold.cli.demo", "the DataParallel tutorial: per-replica batch sizes on N devices (CPU replicas too)"),
    "run": ("fanfold.cli.run", "launch N worker processes of a script (torchrun's contract, tracebacks shown)"),
    "train": ("fanfold.cli.train", "the main job: data-parallel CNN training on the digits dataset"),
    "doctor": ("fanfold.cli.doctor", "what fanfold will do on this machine and why (exit 1 if something is missing)"),
    "secret": ("fanfold.cli.secret", "a new job secret (256 random bits) for FANFOLD_JOB_SECRET or, with --file, "
                                     "FANFOLD_JOB_SECRET_FILE"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, except where there is none to show (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from fanfold import __version__

    parser = argparse.ArgumentParser(prog="fanfold", description="Data parallelism for PyTorch, done right.")
    parser.add_argument("--version", action="version", version=f"fanfold {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._main(args) or 0)
