"""Differential tests: fanfold against an independent oracle (torch's own DDP, one process on the whole batch) over
drawn configurations. See docs/differential.md."""
