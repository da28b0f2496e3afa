"""Portable, safe, atomic checkpoints: ``save(path, state)`` / ``load(path, state)`` with exact resume (every rank's
RNG states, wrapper prefixes reconciled); the file is ``torch.save`` bytes and a sha256 footer, written atomically and
unpickled weights-only. Format and guarantees: docs/checkpoints.md.
"""
from __future__ import annotations

import contextlib
import copy
import glob
import hashlib
import os
import pickle
import random
import secrets
import stat
import struct
import sys
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from .._core.job import rank_world
from .._core.shm import alive
from ..collectives.objects import all_gather_object, broadcast_object, gather_object
from ..collectives.stall import group_transport
from ..parallel.data_parallel import unwrap

__all__ = ["save", "load", "latest", "unwrap_state_dict", "CheckpointError"]

META = "__fanfold__"  # the payload's own entry (format version, kinds, RNG): also tells a footless file apart
MAGIC = b"FANFOLD\x01"
FOOTER = struct.Struct("<8s32sQ")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint was refused (corrupted, truncated, unsafe, or does not fit); nothing live was changed."""


class _HashingWriter:
    """Hashes and counts what torch.save writes through it, so that saving reads nothing back."""

    def __init__(self, file: BinaryIO):
        self.file, self.sha, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def remove_dead_writers_files(path: Path, boot: str) -> list[Path]:
    """Remove (and return) the temporary files of ``path`` whose writer died mid-save: named with this boot and a pid
    that no longer exists, and a regular file of this user with no other name; a live writer's, another boot's or
    host's (a shared filesystem), another user's, and a symbolic link or hard link are never touched."""
    removed = []
    if not boot:
        return removed
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        parts = tmp.name[len(path.name) + 2:].split(".")  # boot, pid, token, "tmp"
        if len(parts) != 4 or parts[0] != boot or not parts[1].isdigit() or alive(int(parts[1])):
            continue
        try:
            st = os.lstat(tmp)
        except FileNotFoundError:  # another rank's save may have removed it first
            continue
        # Only what a writer of this user made can be a dead writer's file. In a shared sticky directory (/tmp)
        # nobody else can rename or remove it either, so the name still holds it at the unlink.
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            continue
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    return removed


def _remove_if_same(path: Path, created: os.stat_result) -> None:
    """Unlink ``path`` only while it still names the file ``created`` describes."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == (created.st_dev, created.st_ino):
            os.unlink(path)


def write_atomic(path: Path, payload: Any) -> None:
    """Write ``payload`` to ``path`` so that a reader sees the old file or the whole new one, never a part."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16]
    except OSError:  # not Linux: no writer is ever judged dead
        boot = ""
    remove_dead_writers_files(path, boot)
    # beside the target (os.replace is atomic within one filesystem), named by boot and pid (remove_dead_writers_files)
    for attempt in range(8):
        tmp = directory / f".{path.name}.{boot or 'noboot'}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            # a new file or nothing: whatever already has the name (a file, a symbolic link) is left alone
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            if attempt == 7:
                raise
    created = os.fstat(fd)
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(payload, writer)
            f.write(FOOTER.pack(MAGIC, writer.sha.digest(), writer.size))
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        _remove_if_same(tmp, created)
        raise
    # the rename is durable only once the directory entry is on disk; some systems cannot open a directory
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _footer(f: BinaryIO, size: int) -> tuple[bytes, int] | None:
    """(sha256, length) when the file ends in a well-formed footer that matches its size, else None."""
    if size < FOOTER.size:
        return None
    f.seek(size - FOOTER.size)
    magic, digest, length = FOOTER.unpack(f.read(FOOTER.size))
    if magic != MAGIC or length != size - FOOTER.size:
        return None
    return digest, length


def _unpickle(path: Path, f: BinaryIO) -> Any:
    f.seek(0)
    try:
        with warnings.catch_warnings():
            # torch warns about a pickle protocol it did not write just before refusing the file: ours says it once
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refuses any global outside torch's allowlist before calling it: the payload never ran.
        lines = [line.strip() for line in str(exc).splitlines()]
        reason = next((line for line in lines if "GLOBAL" in line or "nsupported" in line), lines[0] if lines else "")
        raise CheckpointError(
            f"{path}: refused: it holds pickled objects that are not tensors or plain containers, and fanfold loads "
            f"only with torch.load(weights_only=True), which never runs their code ({reason})") from None
    except Exception as exc:
        # torch's whole first line: cut short, its reason ended mid-sentence
        first = str(exc).splitlines()[0] if str(exc) else ""
        f.seek(0)
        if f.read(4) == b"PK\x03\x04":  # torch.save's zip archive, whose directory at the end is missing or bad
            raise CheckpointError(f"{path}: truncated or corrupted: it begins as a torch checkpoint (a zip archive) "
                                  f"but torch cannot read its end; nothing was loaded ({type(exc).__name__}: "
                                  f"{first})") from None
        raise CheckpointError(f"{path}: not a readable torch checkpoint: truncated, corrupted or another format "
                              f"({type(exc).__name__}: {first})") from None


def read_verified(path: Path) -> Any:
    """Unpickle ``path`` (weights only, tensors on CPU) after checking its checksum; a file without a footer (plain
    ``torch.save``) is read unverified. CheckpointError naming the file for a mismatch, a damaged footer, or content
    the weights-only unpickler refuses."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        footer = _footer(f, size)
        if footer is None:
            f.seek(max(0, size - 2 * FOOTER.size))
            if MAGIC[:7] in f.read():
                raise CheckpointError(f"{path}: damaged or truncated: its fanfold footer does not match the file "
                                      f"size ({size} bytes); nothing was loaded")
            payload = _unpickle(path, f)
            if isinstance(payload, dict) and META in payload:
                # Written by fanfold, so it had a footer: it lost it (cut short) or the footer itself is damaged.
                raise CheckpointError(f"{path}: damaged or truncated: a fanfold checkpoint without its checksum "
                                      f"footer; nothing was loaded")
            return payload
        digest, length = footer
        f.seek(0)
        sha, left = hashlib.sha256(), length
        while left:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise CheckpointError(f"{path}: the file shrank while being read; nothing was loaded")
            sha.update(chunk)
            left -= len(chunk)
        if sha.digest() != digest:
            raise CheckpointError(f"{path}: corrupted: sha256 of its {length} payload bytes is "
                                  f"{sha.hexdigest()[:16]}..., the footer says {digest.hex()[:16]}...; "
                                  "nothing was loaded")
        return _unpickle(path, f)

VERSION = 1
_LEAVES = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def get_rng_state() -> dict[str, Any]:
    """This process's generators (``torch``, ``python``; ``cuda`` and ``numpy`` when in use), weights-only-loadable."""
    version, words, gauss_next = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(words), gauss_next]}
    # Only touch CUDA if the program already did: initialising it here would create a context on every device.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    numpy = sys.modules.get("numpy")  # a program that never imported numpy cannot depend on its generator
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = [str(name), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``get_rng_state`` captured; the generators it did not capture are left as they are."""
    torch.set_rng_state(state["torch"])
    version, words, gauss_next = state["python"]
    random.setstate((version, tuple(words), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        # A machine with fewer devices restores the devices it has; the others' states have nowhere to go.
        for index, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, index)
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype(numpy.uint32), pos, has_gauss, cached))


_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")


def drop_orig_mod(keys: list[str]) -> list[str]:
    return [".".join(part for part in k.split(".") if part != "_orig_mod") for k in keys]


def strip_prefixes(keys: list[str]) -> list[str]:
    # A whole-model wrapper prefixes every key; a compiled submodule adds `_orig_mod` inside the tree.
    while keys:
        prefix = next((p for p in _PREFIXES if all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        keys = [k[len(prefix):] for k in keys]
    return drop_orig_mod(keys)


def unwrap_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with wrapper prefixes removed (``module.``, ``_orig_mod.``, ``_forward_module.``, nested)."""
    stripped = strip_prefixes(list(state_dict))
    if len(set(stripped)) != len(stripped):
        raise CheckpointError(f"state dict keys collide once wrapper prefixes are removed: {list(state_dict)[:10]}")
    return OrderedDict(zip(stripped, state_dict.values()))


def _match_keys(path: Path, name: str, saved: Any, live: Mapping[str, Any], strict: bool) -> dict:
    """``saved`` renamed to the live module's keys; CheckpointError listing missing / unexpected / shape misfits."""
    if not (isinstance(saved, Mapping) and all(isinstance(k, str) for k in saved)):
        raise CheckpointError(f"{path}: entry {name!r} is a {type(saved).__name__}, not a module state dict")
    saved_keys = dict(zip(strip_prefixes(list(saved)), saved))
    live_keys = dict(zip(strip_prefixes(list(live)), live))
    if len(saved_keys) != len(saved) or len(live_keys) != len(live):
        raise CheckpointError(f"{path}: entry {name!r}: keys collide once wrapper prefixes are removed")
    missing = [live_keys[k] for k in live_keys if k not in saved_keys]
    unexpected = [saved_keys[k] for k in saved_keys if k not in live_keys]
    shapes = [f"{live_keys[k]}: saved {tuple(saved[saved_keys[k]].shape)}, model {tuple(live[live_keys[k]].shape)}"
              for k in live_keys if k in saved_keys and isinstance(live[live_keys[k]], torch.Tensor)
              and isinstance(saved[saved_keys[k]], torch.Tensor)
              and saved[saved_keys[k]].shape != live[live_keys[k]].shape]
    if shapes or (strict and (missing or unexpected)):
        parts = [f"{label} ({len(keys)}): {keys[:20]}{' ...' if len(keys) > 20 else ''}"
                 for label, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                     ("shape mismatches", shapes)) if keys]
        raise CheckpointError(f"{path}: entry {name!r} does not fit the model: " + "; ".join(parts))
    return OrderedDict((live_keys[k], saved[saved_keys[k]]) for k in live_keys if k in saved_keys)


def _plain(x: Any, where: str) -> Any:
    """``x`` as weights-only-loadable containers with CPU tensors; TypeError naming the path otherwise."""
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, nn.Parameter):
            raise TypeError(f"{where}: tensor subclass {type(x).__qualname__} cannot be saved in a checkpoint")
        t = x.detach().cpu()
        # A view would drag its whole storage into the file.
        if t.layout == torch.strided and t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        return t
    if type(x) in (dict, OrderedDict):
        return type(x)((k if type(k) in _LEAVES else _plain(k, where), _plain(v, f"{where}[{k!r}]"))
                       for k, v in x.items())
    if type(x) in (list, tuple):
        return type(x)(_plain(v, f"{where}[{i}]") for i, v in enumerate(x))
    if type(x) in _LEAVES:  # exact types: subclasses (numpy scalars, enums) would need their class on load
        return x
    raise TypeError(f"{where}: {type(x).__module__}.{type(x).__qualname__} cannot be saved: a checkpoint holds only "
                    f"tensors and dict/list/tuple/str/int/float/bool/None, so that loading it never runs pickled code")


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _check_state(state: Any) -> None:
    if not isinstance(state, Mapping):
        raise TypeError(f"state must map names to objects or values, got {type(state).__name__}")
    for name in state:
        if not isinstance(name, str) or name == META:
            raise ValueError(f"state: invalid entry name {name!r} (names are str, {META!r} is reserved)")


def save(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write ``state`` to ``path``: rank 0 only, atomically, tensors on CPU, with every rank's RNG states.

    Collective when a process group is initialised; no rank returns before the file is in place. A sharded optimizer
    is consolidated and saved whole (it resumes at any world size); wrappers (DataParallel, DDP, ``torch.compile``)
    are unwrapped, so keys carry no prefix. A value that is not a tensor or plain container raises TypeError naming
    it (on rank 0; the other ranks raise RuntimeError naming rank 0).
    """
    path = Path(path)
    _check_state(state)
    rank, world = rank_world(from_env=False)  # a process with $RANK but no group saves alone
    for obj in state.values():
        # every rank, in the state's order, since consolidating is a collective
        if callable(getattr(obj, "consolidate_state_dict", None)):
            obj.consolidate_state_dict(to=0)
    transport = group_transport(None, "fanfold.save") if world > 1 else None
    rngs = gather_object(get_rng_state(), dst=0, transport=transport) if world > 1 else [get_rng_state()]
    error = None
    if rank == 0:
        try:
            payload, kinds = {}, {}
            for name, obj in state.items():
                if isinstance(obj, nn.Module):
                    # wrappers and a compiled submodule's `_orig_mod` go; other prefixes are the model's own names
                    sd = unwrap(obj).state_dict()
                    kinds[name], data = "module", OrderedDict(zip(drop_orig_mod(list(sd)), sd.values()))
                elif _stateful(obj):
                    kinds[name], data = "object", obj.state_dict()
                else:
                    kinds[name], data = "value", obj
                payload[name] = _plain(data, f"state[{name!r}]")
            payload[META] = _plain({"version": VERSION, "world_size": world, "kinds": kinds, "rng": rngs,
                                    "torch": str(torch.__version__)}, META)
            write_atomic(path, payload)
        except BaseException as exc:  # the other ranks must hear about it rather than wait for the file
            error = exc
    if world > 1:
        # the barrier: rank 0 sends only once the rename is done
        status = broadcast_object(None if error is None else f"{type(error).__name__}: {error}", src=0,
                                  transport=transport)
        if status is not None and rank != 0:
            raise RuntimeError(f"rank {rank}: rank 0 failed to write checkpoint {path}: {status}")
    if error is not None:
        raise error


def _plan(path: Path, payload: Any, state: Mapping[str, Any], strict: bool):
    """Every check, no side effect: (loads to do, plain values to return, the ranks' RNG states or None)."""
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: holds a {type(payload).__name__}, not a dict of named entries")
    meta = payload.get(META)
    entries = {k: v for k, v in payload.items() if k != META}
    kinds: dict = {}
    rngs = None
    if meta is not None:
        if not isinstance(meta, dict) or meta.get("version") != VERSION or not isinstance(meta.get("kinds"), dict):
            raise CheckpointError(f"{path}: unknown fanfold checkpoint format {meta!r:.200}")
        kinds, rngs = meta["kinds"], meta.get("rng")
    elif entries and all(isinstance(v, torch.Tensor) for v in entries.values()):
        # A bare state dict, as torch.save(model.state_dict()) writes it.
        if len(state) != 1 or not isinstance(next(iter(state.values())), nn.Module):
            raise CheckpointError(f"{path}: holds a bare module state dict; pass a state with exactly one module, "
                                  f"e.g. {{'model': model}}")
        entries = {next(iter(state)): entries}
    missing = [n for n in state if n not in entries]
    if missing and strict:
        raise CheckpointError(f"{path}: has no entries {missing} (it holds {sorted(entries)})")
    loads, restored = [], set()
    for name, obj in state.items():
        if name not in entries:
            continue
        kind, data = kinds.get(name), entries[name]
        if _stateful(obj) and kind == "value":
            raise CheckpointError(f"{path}: entry {name!r} was saved as a plain value, not from a {type(obj).__name__}")
        if isinstance(obj, nn.Module):
            target = unwrap(obj)
            loads.append((name, target, _match_keys(path, name, data, target.state_dict(), strict)))
        elif _stateful(obj):
            if isinstance(obj, torch.optim.Optimizer):
                # torch checks this too, but only after the model may already have been loaded
                if not (isinstance(data, Mapping) and isinstance(data.get("param_groups"), list) and "state" in data):
                    raise CheckpointError(f"{path}: entry {name!r} is not an optimizer state dict")
                want = [len(g["params"]) for g in obj.param_groups]
                got = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in data["param_groups"]]
                if want != got:
                    raise CheckpointError(f"{path}: entry {name!r}: the optimizer has parameter groups of sizes "
                                          f"{want}, the checkpoint {got}")
            loads.append((name, obj, data))
        else:
            continue
        restored.add(name)
    plain = {n: v for n, v in entries.items() if n not in restored and (kinds.get(n, "value") == "value" or n in state)}
    if rngs is not None and not (isinstance(rngs, list) and all(isinstance(r, dict) and isinstance(
            r.get("torch"), torch.Tensor) and isinstance(r.get("python"), list) for r in rngs)):
        raise CheckpointError(f"{path}: malformed RNG states")
    return loads, plain, rngs


def _apply(path: Path, loads: list, rng_state: dict | None) -> None:
    before = get_rng_state()
    # modules and optimizers were checked in full; other objects can only be tried: they go first, and are rolled
    # back with the generators if one of them refuses its state
    others = [(n, o, d) for n, o, d in loads if not isinstance(o, (nn.Module, torch.optim.Optimizer))]
    done: list = []
    try:
        if rng_state is not None:
            try:
                set_rng_state(rng_state)
            except Exception as exc:
                raise CheckpointError(f"{path}: its RNG states cannot be restored: {exc}") from None
        for name, obj, data in others:
            done.append((obj, copy.deepcopy(obj.state_dict())))
            try:
                obj.load_state_dict(data)
            except Exception as exc:
                raise CheckpointError(f"{path}: entry {name!r} refused by {type(obj).__name__}: {exc}") from None
    except CheckpointError:
        for obj, snapshot in reversed(done):
            obj.load_state_dict(snapshot)
        set_rng_state(before)
        raise
    for name, obj, data in loads:
        if isinstance(obj, nn.Module):
            obj.load_state_dict(data, strict=False)  # _match_keys already enforced `strict` and the shapes
        elif isinstance(obj, torch.optim.Optimizer):
            obj.load_state_dict(data)


def load(path: str | os.PathLike, state: Mapping[str, Any], *, strict: bool = True, rng: bool = True) -> dict:
    """Restore ``state``'s live objects in place from ``path``; return the checkpoint's plain values.

    Objects (modules, optimizers, schedulers, samplers) get their saved state; modules through any wrapper, wrapper
    prefixes reconciled on both sides. Returns every plain value of the checkpoint (e.g. ``{"step": 120}``) and the
    saved data of names ``state`` maps to plain placeholders. ``strict``: every name of ``state`` and every model
    key must be in the file. ``rng``: each rank restores its own RNG states if the world size is the one that saved
    (else a warning). Plain ``torch.save`` files load too. Collective when a process group is initialised.

    Raises :class:`CheckpointError` naming the file before any live object or generator changed; on every rank if
    any rank failed.
    """
    path = Path(path)
    _check_state(state)
    rank, world = rank_world(from_env=False)
    error = plan = None
    try:
        plan = _plan(path, read_verified(path), state, strict)
    except (CheckpointError, OSError) as exc:
        error = exc
    except Exception as exc:  # a well-formed file whose entries have the wrong shape of data
        error = CheckpointError(f"{path}: malformed checkpoint ({type(exc).__name__}: {exc})")
    if world > 1:
        errors = all_gather_object(None if error is None else f"{type(error).__name__}: {error}",
                                   transport=group_transport(None, "fanfold.load"))
        failed = [r for r, e in enumerate(errors) if e is not None]
        if failed and error is None:
            raise CheckpointError(f"rank {rank}: {path} not loaded: rank {failed[0]} failed: {errors[failed[0]]}")
    if error is not None:
        raise error
    loads, plain, rngs = plan
    rng_state = None
    if rng and rngs is not None:
        if len(rngs) == world:
            rng_state = rngs[rank]
        else:
            warnings.warn(f"{path} was saved by {len(rngs)} ranks, this run has {world}: RNG states not restored "
                          f"(model, optimizer and samplers were)", stacklevel=2)
    _apply(path, loads, rng_state)
    return plain


def latest(directory: str | os.PathLike, pattern: str = "*.pt") -> Path | None:
    """The most recently written complete fanfold checkpoint in ``directory`` matching ``pattern``, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    files = [p for p in directory.glob(pattern) if p.is_file() and not p.name.startswith(".")]
    for p in sorted(files, key=lambda p: p.stat().st_mtime_ns, reverse=True):
        with contextlib.suppress(OSError), open(p, "rb") as f:
            if _footer(f, os.fstat(f.fileno()).st_size) is not None:
                return p
    return None
