"""Placeholder for `fanfold train` (being written)."""


def add_arguments(parser):
    pass


def main(args):
    raise SystemExit("fanfold train: not implemented yet")
