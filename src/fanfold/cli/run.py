"""``fanfold run``: torchrun's flags, parsed for ``fanfold.launcher.launch_script``. Errors name the flag as the user
typed it, never an internal function."""
from __future__ import annotations

import argparse
import re
import signal
import sys

from ..launcher.agent import launch_script


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc-per-node", "--nproc_per_node", type=int, default=None, metavar="N",
                        help="worker processes on this node (default: one per GPU, or 2 without one)")
    parser.add_argument("--nnodes", default="1", help="number of nodes, N or MIN:MAX")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0,
                        help="this node's rank (read by --rdzv-backend static only)")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT",
                        help="rendezvous of a multi-node job (default: single node, on 127.0.0.1)")
    parser.add_argument("--rdzv-backend", "--rdzv_backend", default="c10d",
                        help="torch rendezvous backend of a multi-node job: c10d, static, etcd")
    parser.add_argument("--rdzv-id", "--rdzv_id", default="none",
                        help="job id, the same on every node of a multi-node job")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="K",
                        help="restart all workers up to K times after a failure")
    parser.add_argument("--stall-timeout", "--stall_timeout", default=None, metavar="S",
                        help="seconds a worker's fanfold collective waits for a peer before it diagnoses a stall "
                             "(sets FANFOLD_STALL_TIMEOUT; default: that variable, else 300)")
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("--rank-prefix", action="store_true",
                        help="start every line the workers print with [rank R] (lines are always whole)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show torch's agent log lines and each failed rank's traceback as it happens")
    # Optional for argparse: its own message would call the pass-through arguments required too.
    parser.add_argument("script", nargs="?", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script untouched")
    parser.set_defaults(_run_parser=parser)


def main(args: argparse.Namespace) -> int:
    parser = args._run_parser
    if args.script is None:
        parser.error("no script given: fanfold run [options] SCRIPT [ARGS...]")
    try:
        return launch_script(
            [args.script, *args.script_args], nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
            node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint, rdzv_backend=args.rdzv_backend,
            rdzv_id=args.rdzv_id, max_restarts=args.max_restarts, module=args.module, verbose=args.verbose,
            rank_prefix=args.rank_prefix, stall_timeout=args.stall_timeout,
        )
    except ValueError as exc:
        parser.error(_as_flags(str(exc)))
    except PermissionError as exc:  # the user's job secret file is readable by others, or not theirs
        print(f"fanfold run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the agent took over the signals (no worker had started)
        print("fanfold run: stopped by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT


# launch_script's messages name its Python arguments; the command line names the flags the user typed.
_FLAGS = {"nproc_per_node": "-n/--nproc-per-node", "max_restarts": "--max-restarts", "nnodes": "--nnodes",
          "rdzv_endpoint": "--rdzv-endpoint", "rdzv_backend": "--rdzv-backend", "node_rank": "--node-rank",
          "stall_timeout": "--stall-timeout"}


def _as_flags(message: str) -> str:
    return re.sub(r"\b(" + "|".join(_FLAGS) + r")\b", lambda m: _FLAGS[m.group(1)], message)
