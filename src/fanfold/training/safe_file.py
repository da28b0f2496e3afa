"""The checkpoint file: ``torch.save`` bytes and a 48-byte footer (magic, sha256, length), written atomically, read
after the checksum matched, unpickled weights-only. Bytes and paths only; ``checkpoint`` knows modules and ranks.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import pickle
import secrets
import struct
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .._core.shm import alive

__all__ = ["CheckpointError", "META", "write_atomic", "read_verified", "has_footer"]

META = "__fanfold__"  # the payload's own entry (format version, kinds, RNG): also tells a footless file apart
MAGIC = b"FANFOLD\x01"
FOOTER = struct.Struct("<8s32sQ")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint was refused (corrupted, truncated, unsafe, or does not fit); nothing live was changed."""


class _HashingWriter:
    """A write-only file that hashes and counts what passes through, so the file is read only once on save."""

    def __init__(self, file: BinaryIO):
        self.file, self.sha, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk; some systems cannot open a directory.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _boot_id() -> str:
    """This boot's identity (Linux), or "" where the system does not say: then no writer is ever judged dead."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16]
    except OSError:
        return ""


def remove_dead_writers_files(path: Path, boot: str) -> list[Path]:
    """Remove the temporary files that writers of ``path`` left when they died (a SIGKILL mid-save): those named
    with this boot and a pid that no longer exists. A live writer's file, or one of another boot or host (a shared
    filesystem), is never touched. Returns what was removed."""
    removed = []
    if not boot:
        return removed
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        parts = tmp.name[len(path.name) + 2:].split(".")  # boot, pid, token, "tmp"
        if len(parts) != 4 or parts[0] != boot or not parts[1].isdigit() or alive(int(parts[1])):
            continue
        with contextlib.suppress(FileNotFoundError):  # another rank's save may have removed it first
            tmp.unlink()
            removed.append(tmp)
    return removed


def write_atomic(path: Path, payload: Any) -> None:
    """Write ``payload`` to ``path`` so that a reader sees the old file or the whole new one, never a part."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    boot = _boot_id()
    remove_dead_writers_files(path, boot)
    # Same directory as the target: os.replace is atomic only within one filesystem. The name says who writes it
    # (this boot, this pid), so that a later save can tell a dead writer's leftover from a live writer's file.
    tmp = directory / f".{path.name}.{boot or 'noboot'}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(payload, writer)
            f.write(FOOTER.pack(MAGIC, writer.sha.digest(), writer.size))
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _footer(f: BinaryIO, size: int) -> tuple[bytes, int] | None:
    """(sha256, length) when the file ends in a well-formed footer that matches its size, else None."""
    if size < FOOTER.size:
        return None
    f.seek(size - FOOTER.size)
    magic, digest, length = FOOTER.unpack(f.read(FOOTER.size))
    if magic != MAGIC or length != size - FOOTER.size:
        return None
    return digest, length


def has_footer(path: Path) -> bool:
    """Cheap test (no hashing) that ``path`` looks like a complete fanfold checkpoint."""
    try:
        with open(path, "rb") as f:
            return _footer(f, os.fstat(f.fileno()).st_size) is not None
    except OSError:
        return False


def _unpickle(path: Path, f: BinaryIO) -> Any:
    f.seek(0)
    try:
        with warnings.catch_warnings():
            # torch warns about a pickle protocol it did not write just before refusing the file: the refusal
            # below says it all, once
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
