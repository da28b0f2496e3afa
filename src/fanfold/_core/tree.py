"""One walk over nested data: flatten a structure to (path, leaf) pairs and a spec, rebuild it from new leaves.

Containers walked: tuple, list, dict (and their subclasses), namedtuple, torch's structseq return types and dataclass
instances. Everything else is a leaf: tensors, numbers, strings, None, and ``PackedSequence``, whose four fields are
not independent (splitting its ``data`` row-wise would not give valid sequences), so scatter/gather treat it whole.

Each leaf carries a path such as ``inputs[1]['mask']`` or ``outputs.logits`` for error messages. Scatter and gather
(``scatter_gather.py``) are flatten -> work on the leaf list -> unflatten; no recursive closure is kept alive.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import torch
from torch.nn.utils.rnn import PackedSequence


class Spec(NamedTuple):
    """The shape of a structure without its leaves. ``kind`` is "leaf" or the container kind."""

    kind: str
    template: Any = None  # the container type, or an instance to copy (dict subclasses, dataclasses)
    keys: tuple = ()  # indices, field names or dict keys, in order
    children: tuple = ()  # one Spec per key


LEAF = Spec("leaf")


_EXACT = {tuple: "tuple", list: "list", dict: "dict"}


def _kind(obj: Any) -> str:
    kind = _EXACT.get(type(obj))  # the common cases first: this runs on every call of a DataParallel forward
    if kind is not None:
        return kind
    if isinstance(obj, (torch.Tensor, PackedSequence)):
        return "leaf"
    if isinstance(obj, tuple):
        if hasattr(obj, "_fields"):
            return "namedtuple"
        return "tuple" if type(obj) is tuple else "structseq"
    if isinstance(obj, list):
        return "list"
    if isinstance(obj, dict):
        return "dict"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return "dataclass"
    return "leaf"


def child_path(path: str, kind: str, key: Any) -> str:
    """The path of one child: ``p[0]`` in sequences, ``p['k']`` in dicts, ``p.field`` in namedtuples/dataclasses."""
    if kind in ("namedtuple", "dataclass"):
        return f"{path}.{key}"
    return f"{path}[{key!r}]"


def _children(obj: Any, kind: str) -> tuple[tuple, list]:
    if kind == "dict":
        return tuple(obj.keys()), list(obj.values())
    if kind == "namedtuple":
        return tuple(obj._fields), list(obj)
    if kind == "dataclass":
        names = tuple(f.name for f in dataclasses.fields(obj))
        return names, [getattr(obj, n) for n in names]
    return tuple(range(len(obj))), list(obj)


def flatten(obj: Any, path: str = "") -> tuple[list[tuple[str, Any]], Spec]:
    """Return the leaves of ``obj`` as ``(path, leaf)`` pairs in a fixed order, and the spec to rebuild it."""
    leaves: list[tuple[str, Any]] = []
    spec = _flatten(obj, path, leaves)
    return leaves, spec


def _flatten(obj: Any, path: str, leaves: list) -> Spec:
    kind = _kind(obj)
    if kind == "leaf":
        leaves.append((path, obj))
        return LEAF
    keys, values = _children(obj, kind)
    children = tuple(_flatten(v, child_path(path, kind, k), leaves) for k, v in zip(keys, values))
    return Spec(kind, _template(obj, kind, keys), keys, children)


def _template(obj: Any, kind: str, keys: tuple) -> Any:
    """What ``unflatten`` copies to rebuild ``obj``: its type, or for dict subclasses and dataclasses an empty copy.
    Empty, so that a spec holds none of the leaves: a spec crosses process boundaries (DataParallel's process
    engine pickles it), where a tensor of the graph could not go, and it should not keep the batch alive."""
    if kind == "dict" and type(obj) is not dict:
        out = copy.copy(obj)
        out.clear()
        return out
    if kind == "dataclass":
        out = copy.copy(obj)
        for name in keys:
            object.__setattr__(out, name, None)
        return out
    return type(obj)


def unflatten(spec: Spec, leaves: list) -> Any:
    """Rebuild a structure of shape ``spec`` from ``leaves`` (in ``flatten``'s order)."""
    it = iter(leaves)
    out = _unflatten(spec, it)
    if next(it, it) is not it:
        raise ValueError(f"unflatten: more leaves than the spec holds ({len(leaves)} given)")
    return out


def _unflatten(spec: Spec, it) -> Any:
    if spec.kind == "leaf":
        try:
            return next(it)
        except StopIteration:
            raise ValueError("unflatten: fewer leaves than the spec holds") from None
    values = [_unflatten(c, it) for c in spec.children]
    if spec.kind == "tuple":
        return tuple(values)
    if spec.kind == "list":
        return values
    if spec.kind == "namedtuple":
        return spec.template(*values)
    if spec.kind == "structseq":
        return spec.template(values)
    if spec.kind == "dict":
        if spec.template is dict:
            return dict(zip(spec.keys, values))
        # a copy keeps the subclass's own state (a defaultdict's factory, an OrderedDict's type)
        out = copy.copy(spec.template)
        out.clear()
        out.update(zip(spec.keys, values))
        return out
    # dataclass: copy and set the fields rather than call __init__, so that __post_init__ checks written for the
    # whole batch do not run on a slice, and init=False fields and frozen classes work too
    out = copy.copy(spec.template)
    for name, value in zip(spec.keys, values):
        object.__setattr__(out, name, value)
    return out


def _describe(spec: Spec) -> str:
    if spec.kind == "leaf":
        return "a leaf"
    name = spec.template.__name__ if isinstance(spec.template, type) else type(spec.template).__name__
    what = "keys" if spec.kind == "dict" else ("fields" if spec.kind in ("namedtuple", "dataclass") else "length")
    detail = len(spec.keys) if what == "length" else list(spec.keys)
    return f"a {name} with {what} {detail}"


def _type_of(spec: Spec) -> type | None:
    if spec.kind == "leaf":
        return None
    return spec.template if isinstance(spec.template, type) else type(spec.template)


def first_difference(a: Spec, b: Spec, path: str = "") -> str | None:
    """Where two specs first differ, as ``"<path>: <a> vs <b>"``; None when they match."""
    if a.kind != b.kind or a.keys != b.keys or _type_of(a) is not _type_of(b):
        return f"{path or '<root>'}: {_describe(a)} vs {_describe(b)}"
    for key, ca, cb in zip(a.keys, a.children, b.children):
        diff = first_difference(ca, cb, child_path(path, a.kind, key))
        if diff is not None:
            return diff
    return None
