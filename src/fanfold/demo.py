"""Placeholder for `fanfold demo` (being written)."""


def add_arguments(parser):
    pass


def main(args):
    raise SystemExit("fanfold demo: not implemented yet")
