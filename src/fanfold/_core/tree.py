"""One walk over nested data: flatten a structure to (path, leaf) pairs and a spec, rebuild it from new leaves.
Containers: tuple, list, dict (and subclasses), namedtuple, torch's structseq types, dataclass instances; anything
else is a leaf, ``PackedSequence`` included. Paths such as ``inputs[1]['mask']`` name leaves in error messages."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import torch
from torch.nn.utils.rnn import PackedSequence


class Node(NamedTuple):
    kind: str  # "leaf" or the container kind
    template: Any = None  # the container type, or an instance to copy (dict subclasses, dataclasses)
    keys: tuple = ()  # indices, field names or dict keys, in order: one child each


class Spec(NamedTuple):
    """A structure's nodes in preorder, without its leaves: flat, so that neither walking nor pickling it recurses."""

    nodes: tuple


_LEAF_NODE = Node("leaf")


class Path(NamedTuple):
    """A leaf's place, e.g. ``inputs[1]['mask']``, made into text only when printed (eager paths of a structure
    nested n deep would cost n^2 characters)."""

    parent: Path | str
    part: str

    def __str__(self) -> str:
        parts, node = [], self
        while isinstance(node, Path):
            parts.append(node.part)
            node = node.parent
        parts.append(node)
        return "".join(reversed(parts))

    def __repr__(self) -> str:
        return repr(str(self))


_EXACT = {tuple: "tuple", list: "list", dict: "dict"}


def _kind(obj: Any) -> str:
    kind = _EXACT.get(type(obj))  # the common cases first: this runs on every call of a DataParallel forward
    if kind is not None:
        return kind
    if isinstance(obj, (torch.Tensor, PackedSequence)):
        return "leaf"
    if isinstance(obj, tuple):  # a subclass: plain tuples are in _EXACT
        return "namedtuple" if hasattr(obj, "_fields") else "structseq"
    if isinstance(obj, (list, dict)):
        return "list" if isinstance(obj, list) else "dict"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return "dataclass"
    return "leaf"


def _child_path(path: Path | str, kind: str, key: Any) -> Path:
    return Path(path, f".{key}" if kind in ("namedtuple", "dataclass") else f"[{key!r}]")


def _open(obj: Any, kind: str) -> tuple[tuple, list, Any]:
    # keys, values, and the template: the type, or an empty copy (dict subclasses, dataclasses), as a spec holds no
    # leaf: it must not keep a batch alive
    if kind == "dict":
        template = dict
        if type(obj) is not dict:
            template = copy.copy(obj)
            template.clear()
        return tuple(obj.keys()), list(obj.values()), template
    if kind == "dataclass":
        template = copy.copy(obj)
        names = tuple(f.name for f in dataclasses.fields(obj))
        for name in names:
            object.__setattr__(template, name, None)
        return names, [getattr(obj, n) for n in names], template
    return tuple(obj._fields if kind == "namedtuple" else range(len(obj))), list(obj), type(obj)


_EXIT = object()  # marks, on flatten's stack, the end of a container's children


def flatten(obj: Any, path: str = "") -> tuple[list[tuple[Path | str, Any]], Spec]:
    """Return the leaves of ``obj`` as ``(path, leaf)`` pairs in a fixed order, and the spec to rebuild it.
    Iterative (an explicit stack): any depth works; a container that holds itself is refused."""
    leaves: list[tuple[Path | str, Any]] = []
    nodes: list[Node] = []
    open_ids: set[int] = set()  # the containers being walked: one met again inside itself is a cycle
    stack: list[tuple[Any, Any]] = [(obj, path)]
    while stack:
        item, where = stack.pop()
        if item is _EXIT:
            open_ids.discard(where)
            continue
        kind = _kind(item)
        if kind == "leaf":
            leaves.append((where, item))
            nodes.append(_LEAF_NODE)
            continue
        if id(item) in open_ids:
            raise ValueError(f"{where or '<root>'} contains itself: a structure with a cycle cannot be split or "
                             f"rebuilt")
        keys, values, template = _open(item, kind)
        nodes.append(Node(kind, template, keys))
        open_ids.add(id(item))
        stack.append((_EXIT, id(item)))
        for key, value in zip(reversed(keys), reversed(values)):
            stack.append((value, _child_path(where, kind, key)))
    return leaves, Spec(tuple(nodes))


def unflatten(spec: Spec, leaves: list) -> Any:
    """Rebuild a structure of shape ``spec`` from ``leaves`` (in ``flatten``'s order). Iterative, as ``flatten``."""
    it = iter(leaves)
    open_nodes: list[tuple[Node, list]] = []  # containers whose children are being collected
    result = None
    for node in spec.nodes:
        if node.kind == "leaf":
            value = next(it, it)
            if value is it:
                raise ValueError("unflatten: fewer leaves than the spec holds")
        elif node.keys:
            open_nodes.append((node, []))
            continue
        else:
            value = _build(node, [])
        while open_nodes:  # hand the value to its container; a container that is complete is built and handed on
            parent, values = open_nodes[-1]
            values.append(value)
            if len(values) < len(parent.keys):
                break
            open_nodes.pop()
            value = _build(parent, values)
        else:
            result = value
    if next(it, it) is not it:
        raise ValueError(f"unflatten: more leaves than the spec holds ({len(leaves)} given)")
    return result


def _build(node: Node, values: list) -> Any:
    kind = node.kind
    if kind == "tuple":
        return tuple(values)
    if kind == "list":
        return values
    if kind == "namedtuple":
        return node.template(*values)
    if kind == "structseq":
        return node.template(values)
    if node.template is dict:
        return dict(zip(node.keys, values))
    # A copy keeps a dict subclass's state (a defaultdict's factory). A dataclass's fields are set, not passed to
    # __init__: __post_init__ checks meant for the whole batch must not run on a slice; frozen classes work too.
    out = copy.copy(node.template)
    if kind == "dict":
        out.update(zip(node.keys, values))
        return out
    for name, value in zip(node.keys, values):
        object.__setattr__(out, name, value)
    return out


def _describe(node: Node) -> tuple[type | None, str]:
    if node.kind == "leaf":
        return None, "a leaf"
    cls = node.template if isinstance(node.template, type) else type(node.template)
    what = "keys" if node.kind == "dict" else ("fields" if node.kind in ("namedtuple", "dataclass") else "length")
    detail = len(node.keys) if what == "length" else list(node.keys)
    return cls, f"a {cls.__name__} with {what} {detail}"


def first_difference(a: Spec, b: Spec, path: str = "") -> str | None:
    """Where two specs first differ, as ``"<path>: <a> vs <b>"``; None when they match."""
    open_nodes: list[list] = []  # [path, kind, keys, index of the next child] of the containers being compared
    for na, nb in zip(a.nodes, b.nodes):
        while open_nodes and open_nodes[-1][3] == len(open_nodes[-1][2]):
            open_nodes.pop()
        where: Path | str = path
        if open_nodes:
            top = open_nodes[-1]
            where = _child_path(top[0], top[1], top[2][top[3]])
            top[3] += 1
        (type_a, a_is), (type_b, b_is) = _describe(na), _describe(nb)
        if na.kind != nb.kind or na.keys != nb.keys or type_a is not type_b:
            return f"{where or '<root>'}: {a_is} vs {b_is}"
        if na.keys:
            open_nodes.append([where, na.kind, na.keys, 0])
    return None
