"""Walks over the nested inputs and outputs the differential tests draw (tuples, lists, dicts, dataclasses): the
oracle's own, written apart from fanfold's ``_core.tree`` so that a bug there cannot hide in both sides."""
from __future__ import annotations

from dataclasses import fields, is_dataclass

import torch


def map_tree(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tree(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tree(v, fn) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: map_tree(getattr(obj, f.name), fn) for f in fields(obj)})
    return obj


def cat_tree(parts: list):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, (tuple, list)):
        return type(first)(cat_tree([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: cat_tree([p[k] for p in parts]) for k in first}
    if is_dataclass(first):
        return type(first)(**{f.name: cat_tree([getattr(p, f.name) for p in parts]) for f in fields(first)})
    return first
