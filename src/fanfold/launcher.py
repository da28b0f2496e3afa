"""Placeholder for `fanfold launcher` (being written)."""


def add_arguments(parser):
    pass


def main(args):
    raise SystemExit("fanfold launcher: not implemented yet")
