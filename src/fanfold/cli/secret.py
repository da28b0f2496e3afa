"""``fanfold secret``: a new job secret (256 random bits as 64 hex digits), printed, or written to a new file only
its owner can read, for ``FANFOLD_JOB_SECRET`` / ``FANFOLD_JOB_SECRET_FILE`` on every node of a job."""
from __future__ import annotations

import argparse
import os
import sys

from .._core.job import SECRET_ENV, SECRET_FILE_ENV, new_secret


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", metavar="PATH", default=None,
                        help=f"write the secret to PATH, a new file of mode 0600 (an existing PATH is refused), for "
                             f"{SECRET_FILE_ENV}, instead of printing it for {SECRET_ENV}")


def main(args: argparse.Namespace) -> int:
    secret = new_secret()
    if args.file is None:
        print(secret)
        return 0
    try:
        # a new file or nothing: never through a symbolic link, never over a file someone else made
        fd = os.open(args.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        print(f"fanfold secret: cannot create {args.file}: {exc.strerror} (it must not exist yet)", file=sys.stderr)
        return 2
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    print(f"fanfold secret: wrote a new job secret to {args.file} (mode 0600); give every node the same file: "
          f"{SECRET_FILE_ENV}={args.file} fanfold run ...", file=sys.stderr)
    return 0
