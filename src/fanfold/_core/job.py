"""The job this process belongs to: its rank and world size, and its rendezvous store: a key-value server admitting
only processes that prove the job's secret (HMAC-SHA256 both ways; ``FANFOLD_JOB_SECRET`` or a 0600 file named by
``FANFOLD_JOB_SECRET_FILE``; at least 128 bits as written) and its client, a ``torch.distributed.Store``; every
request and answer after the proof travels sealed with the connection's own keys (``channel.py``).
Connections that have not proved the secret are bounded in number, in time and in failed guesses per address, so
that a flood or a guesser does not keep the job's own clients out. Threat model: docs/reliability.md."""
from __future__ import annotations

import contextlib
import errno
import hmac
import importlib
import logging
import os
import resource
import secrets
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from .channel import HELLO, NONCE, PROOF, Channel, TamperedError, handshake, recv_exact
from .rounds import agent_store_shared, round_store

SECRET_ENV = "FANFOLD_JOB_SECRET"
SECRET_FILE_ENV = "FANFOLD_JOB_SECRET_FILE"
STORE_ENV = "FANFOLD_JOB_STORE"  # "1": MASTER_ADDR:MASTER_PORT is a StoreServer (fanfold's launchers set it)

_HANDSHAKE_S = 10.0  # how long a client waits for the server's greeting and its proof
_PROOF_S = 5.0  # a connection that has not proved the secret this long after its greeting is closed
_PENDING_PER_SOURCE = 8  # connections from one address that have not proved the secret yet
_EVICT_AFTER_S = 1.0  # past a cap, an unproved connection this old makes room for a new one
_FREE_FAILURES = 5  # failed proofs from one address before its next connections are greeted only after a pause
_PAUSE_MAX_S = 2.0
_FAILURE_WINDOW_S = 60.0  # failures older than this are forgotten; one log line per source per window
MIN_SECRET_CHARS = 32  # 128 bits written as hex digits, more in any larger alphabet
_MIN_DISTINCT = 8  # "aaaa..." is long but no secret
_log = logging.getLogger(__name__)
_OK, _TIMEOUT, _ERROR = b"\x00", b"\x01", b"\x02"


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def require_initialized(who: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"{who} needs an initialised process group: call "
                           "fanfold.distributed.init_process_group() first (under `fanfold run` or fanfold.launch)")


def rank_world(group: Any = None, *, from_env: bool = True) -> tuple[int, int]:
    """(rank, world size) in ``group`` when a process group is up; otherwise ``$RANK``/``$WORLD_SIZE`` (a launched
    process before ``init_process_group``) when ``from_env``, else (0, 1): one process."""
    if is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if from_env:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return 0, 1


class AuthenticationError(RuntimeError):
    """The other end of a store connection did not prove the job's secret."""


def new_secret() -> str:
    return secrets.token_hex(32)


def check_secret(secret: bytes, where: str) -> bytes:
    """``secret`` when it is at least :data:`MIN_SECRET_CHARS` long with at least 8 different characters (128 bits if
    it is hex digits, more otherwise: fanfold cannot tell a random secret from a guessable one of the same length);
    PermissionError naming ``where`` and how to make one otherwise."""
    if len(secret) < MIN_SECRET_CHARS or len(set(secret)) < _MIN_DISTINCT:
        raise PermissionError(
            f"{where} is too weak to guard the job's store: {len(secret)} characters, {len(set(secret))} different; a "
            f"job secret needs at least {MIN_SECRET_CHARS} characters (128 bits as hex digits), at least "
            f"{_MIN_DISTINCT} of them different. Make one with `fanfold secret` (prints 64 random hex digits) or "
            f"`fanfold secret --file PATH` (writes them to a new file only you can read, for {SECRET_FILE_ENV})")
    return secret


_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link"}


def _secret_file(path: str) -> bytes:
    """The stripped content of ``path``: a regular file of this user closed to others; anything else (a FIFO, a
    device, a directory, a socket, a symbolic link) is refused before it is read, at once."""
    where = f"{SECRET_FILE_ENV}={path!r}"
    try:
        before = os.lstat(path)  # judged before opening: opening a FIFO waits for a writer, a device may act
    except OSError as exc:
        raise PermissionError(f"{where} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(before.st_mode):
        kind = _KINDS.get(stat.S_IFMT(before.st_mode), "not a regular file")
        raise PermissionError(f"{where} is {kind}, not a regular file: name the file that holds the secret itself "
                              f"(a symbolic link is refused too)")
    try:
        # O_NONBLOCK: a FIFO swapped in since the lstat does not block the open; it is refused below
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise PermissionError(f"{where} cannot be opened: {exc.strerror} (a symbolic link is refused: name the "
                              f"file itself)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise PermissionError(f"{where} was replaced while being opened; not read")
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{where} belongs to uid {st.st_uid}, not to this job's user "
                                  f"(uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise PermissionError(f"{where} has mode {stat.S_IMODE(st.st_mode):04o}: other users "
                                  f"may read or write it; make it readable by its owner only: chmod 600 {path}")
        data = os.read(fd, 1 << 20).strip()  # a regular file: read whole unless it is larger (no secret is)
    finally:
        os.close(fd)
    if not data:
        raise PermissionError(f"{where} is empty")
    return data


def job_secret() -> bytes | None:
    """The job's secret from ``FANFOLD_JOB_SECRET``, else the stripped content of the file named by
    ``FANFOLD_JOB_SECRET_FILE``, which must be a regular file of this user closed to others; either must pass
    :func:`check_secret`. PermissionError otherwise; None when neither is set."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return check_secret(value.encode(), SECRET_ENV)
    path = os.environ.get(SECRET_FILE_ENV)
    if not path:
        return None
    return check_secret(_secret_file(path), f"the secret in {SECRET_FILE_ENV}={path!r}")


def _recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes before ``deadline`` (time.monotonic), however slowly they trickle in; TimeoutError otherwise."""
    data = bytearray()
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the handshake's deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the store connection was closed by the other end")
        data += chunk
    return bytes(data)


@dataclass
class _Unproved:
    """A connection that has not proved the secret yet."""

    conn: socket.socket
    source: str
    since: float


@dataclass
class _Failures:
    """Failed proofs from one address within the window."""

    count: int = 0
    last: float = 0.0
    logged: float = float("-inf")


class _Gate:
    """Admission before the secret is proved, so that a flood takes neither the server's handles nor its threads:
    at most ``per_source`` unproved connections from one address and ``total`` in all. A connection past a cap
    replaces the oldest unproved one that has had ``_EVICT_AFTER_S`` to prove itself (an idle intruder's), or is
    closed before its greeting (a client of the job tries again). Failed proofs are counted by address: past
    ``_FREE_FAILURES`` within ``_FAILURE_WINDOW_S``, that address's connections are greeted only after a pause
    growing to ``_PAUSE_MAX_S``, which bounds its guesses to ``per_source`` per pause."""

    def __init__(self, per_source: int, total: int):
        self.per_source, self.total = per_source, total
        self._lock = threading.Lock()
        self._unproved: dict[socket.socket, _Unproved] = {}
        self._failures: dict[str, _Failures] = {}

    def enter(self, conn: socket.socket, source: str) -> bool:
        now = time.monotonic()
        with self._lock:
            crowd = [u for u in self._unproved.values() if u.source == source]
            if len(crowd) < self.per_source:
                crowd = list(self._unproved.values()) if len(self._unproved) >= self.total else []
            if crowd:
                oldest = min(crowd, key=lambda u: u.since)
                if now - oldest.since < _EVICT_AFTER_S:
                    return False
                self._evict(oldest)
            self._unproved[conn] = _Unproved(conn, source, now)
            return True

    def evict_oldest(self) -> None:
        """Free a handle: out of them, the oldest unproved connection goes, however young."""
        with self._lock:
            if self._unproved:
                self._evict(min(self._unproved.values(), key=lambda u: u.since))

    def _evict(self, victim: _Unproved) -> None:
        del self._unproved[victim.conn]
        # shut down, not closed: its own thread closes it, so its descriptor cannot be reused under that thread
        with contextlib.suppress(OSError):
            victim.conn.shutdown(socket.SHUT_RDWR)

    def leave(self, conn: socket.socket) -> None:
        """``conn`` no longer counts: it proved the secret, or it is gone."""
        with self._lock:
            self._unproved.pop(conn, None)

    def pause(self, source: str) -> float:
        with self._lock:
            f = self._failures.get(source)
            if f is None or f.count <= _FREE_FAILURES or time.monotonic() - f.last > _FAILURE_WINDOW_S:
                return 0.0
            return min(_PAUSE_MAX_S, 0.25 * 2 ** (f.count - _FREE_FAILURES - 1))

    def failed(self, source: str) -> int:
        """Count a failed proof from ``source``; the failures to report when this source is due a log line, else 0."""
        now = time.monotonic()
        with self._lock:
            if len(self._failures) > 4096:  # many addresses (127.0.0.0/8 is all loopback): forget the stale ones
                self._failures = {k: v for k, v in self._failures.items() if now - v.last <= _FAILURE_WINDOW_S}
            f = self._failures.setdefault(source, _Failures())
            if now - f.last > _FAILURE_WINDOW_S:
                f.count = 0
            f.count, f.last = f.count + 1, now
            if now - f.logged < _FAILURE_WINDOW_S:
                return 0
            f.logged = now
            return f.count


class StoreServer:
    """Serves one job's keys on ``host`` (a free port) to clients that prove ``secret``. One thread accepting, one
    per connection; unproved connections are bounded (:class:`_Gate`) and have ``_PROOF_S`` to prove the secret."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1"):
        self._secret = secret
        self._sock = socket.create_server((host, 0), backlog=128)
        self.host, self.port = self._sock.getsockname()[:2]
        self._store = dist.HashStore()  # a TCPStore's semantics; its waits release the GIL
        self._conns: set[socket.socket] = set()
        self._closed = False
        handles = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        handles = 1 << 16 if handles == resource.RLIM_INFINITY else handles
        # a quarter of this process's handles at most, so that a flood leaves the job's own the rest
        self._gate = _Gate(_PENDING_PER_SOURCE, max(_PENDING_PER_SOURCE, min(128, handles // 4)))
        Channel.cipher()  # loaded now, not while the first client waits for its proof
        threading.Thread(target=self._accept, name=f"fanfold-store-{self.port}", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for s in [self._sock, *list(self._conns)]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        backoff = 0.01
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError as exc:
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    return  # the listening socket is closed
                # Out of handles (EMFILE, ENFILE) or memory (ENOBUFS, ENOMEM), or a connection that died in the
                # backlog: none is the end of the store. Make room if handles ran out, wait, and accept again.
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._gate.evict_oldest()
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
                continue
            backoff = 0.01
            if not self._gate.enter(conn, peer[0]):
                conn.close()
                continue
            self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn, peer[0]), daemon=True).start()
            except RuntimeError:  # no thread to be had now: as if out of handles
                self._gate.leave(conn)
                self._conns.discard(conn)
                conn.close()
                time.sleep(backoff)

    def _admit(self, conn: socket.socket, source: str) -> Channel | None:
        pause = self._gate.pause(source)
        if pause:
            time.sleep(pause)
        deadline = time.monotonic() + _PROOF_S  # a whole deadline: a proof trickled in byte by byte gains nothing
        server_nonce = secrets.token_bytes(NONCE)
        conn.settimeout(_PROOF_S)
        conn.sendall(HELLO + server_nonce)
        reply = _recv_by(conn, NONCE + PROOF, deadline)
        keys = handshake(self._secret, server_nonce, reply[:NONCE])
        if not hmac.compare_digest(reply[NONCE:], keys.client_proof):
            failures = self._gate.failed(source)
            if failures:
                _log.warning("fanfold's job store on port %d: %s failed the handshake, %d time(s) so far (a process "
                             "without this job's secret); past %d failures its connections are greeted only after a "
                             "pause; this address is reported at most once every %g s",
                             self.port, source, failures, _FREE_FAILURES, _FAILURE_WINDOW_S)
            return None
        self._gate.leave(conn)
        conn.sendall(keys.server_proof)
        conn.settimeout(None)  # an admitted client may stay idle for the whole job
        return Channel(conn, keys.server_key, keys.client_key)

    def _serve(self, conn: socket.socket, source: str) -> None:
        try:
            channel = self._admit(conn, source)
            while channel is not None and not self._closed:
                try:
                    request = channel.recv()
                except TamperedError as exc:
                    self._tampered(channel, source, exc)
                    return
                try:
                    answer = self._answer(request[0].decode(), request[1:])
                except (IndexError, TypeError, ValueError, UnicodeDecodeError) as exc:  # malformed: say so, go on
                    answer = [_ERROR, f"malformed store request: {type(exc).__name__}: {exc}".encode()]
                channel.send(*answer)
        except (OSError, ConnectionError, struct.error):
            pass  # the client went away (or never proved the secret in time, or was evicted)
        finally:
            self._gate.leave(conn)  # gone: no longer counted
            self._conns.discard(conn)
            conn.close()

    def _tampered(self, channel: Channel, source: str, exc: TamperedError) -> None:
        """A request that did not open: say so to the client, sealed (it alone can read and trust that), and end the
        connection, whose sequence is broken."""
        _log.warning("fanfold's job store on port %d: a request on a connection from %s did not open (%s); "
                     "something between the client and the store tampers with the traffic; connection closed",
                     self.port, source, exc)
        with contextlib.suppress(OSError):
            channel.send(_ERROR, f"the store received a request on this connection that failed authentication ({exc}):"
                                 f" something between this process and the store tampers with the traffic; the store "
                                 f"closed the connection".encode())
            channel.sock.shutdown(socket.SHUT_WR)

    def _answer(self, op: str, args: list[bytes]) -> list[bytes]:
        store = self._store
        if op in ("get", "wait"):  # args: timeout in ms, then the keys
            keys = [k.decode() for k in args[1:]]
            try:
                store.wait(keys, timedelta(milliseconds=int(args[0])))
            except dist.DistStoreError:
                missing = [k for k in keys if not store.check([k])]
                return [_TIMEOUT, f"keys {missing} not set within {int(args[0]) / 1000:g} s".encode()]
            return [_OK, *(store.multi_get(keys) if op == "get" else [])]
        if op == "multi_set":  # keys as bytes: HashStore takes them as they are
            half = len(args) // 2
            args = [args[:half], args[half:]]
        elif op == "check":
            args = [args]
        elif op == "add":
            args = [args[0], int(args[1])]
        elif op not in ("set", "append", "compare_set", "delete_key", "num_keys"):
            return [_ERROR, f"unknown store request {op!r}".encode()]
        result = getattr(store, op)(*args)  # bytes, None, or a number or bool sent as its decimal digits
        return [_OK] if result is None else [_OK, result if isinstance(result, bytes) else b"%d" % result]


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class JobStore(dist.Store):
    """A client of a :class:`StoreServer` at ``host:port``, used by torch as a TCPStore. Connecting retries until
    ``timeout`` while nothing listens; a server that cannot prove ``secret``, or refuses ours, is an
    :class:`AuthenticationError` at once. torch holds a store through its C++ half only: whoever hands one to
    torch keeps this object alive while torch uses it."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self.set_timeout(timeout)
        self._where = f"{host}:{port}"
        self._address, self._secret = (host, port), secret
        self._lock = threading.Lock()
        self._clones: list[JobStore] = []
        self._failed = ""  # why the connection was given up, for the calls that come after
        self._channel: Channel | None = self._connect(host, port, secret, timeout.total_seconds())

    def _connect(self, host: str, port: int, secret: bytes, timeout: float) -> Channel:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=_HANDSHAKE_S)
            except OSError as exc:  # nothing listens yet (refused, unreachable, timed out)
                error = exc
            else:
                try:
                    hello = recv_exact(sock, len(HELLO) + NONCE)
                    break
                except ConnectionError as exc:  # closed before its greeting: a server busy with a flood; again
                    sock.close()
                    error = exc
                except BaseException:
                    sock.close()
                    raise
            if time.monotonic() + delay > deadline:
                raise dist.DistStoreError(f"fanfold's job store at {self._where} did not answer within "
                                          f"{timeout:g} s: {error}") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not hello.startswith(HELLO):
                raise AuthenticationError(f"{self._where} is not fanfold's job store of this version (it greeted with "
                                          f"{hello[:16]!r}, not {HELLO!r})")
            server_nonce, client_nonce = hello[len(HELLO):], secrets.token_bytes(NONCE)
            keys = handshake(secret, server_nonce, client_nonce)
            sock.sendall(client_nonce + keys.client_proof)
            try:
                answer = recv_exact(sock, PROOF)
            except ConnectionError:
                raise AuthenticationError(
                    f"fanfold's job store at {self._where} refused this process: its secret is not this job's "
                    f"(check {SECRET_ENV} / {SECRET_FILE_ENV} on every node)") from None
            if not hmac.compare_digest(answer, keys.server_proof):
                raise AuthenticationError(f"the store at {self._where} could not prove the job's secret: not this "
                                          f"job's store (another process may have taken its port); nothing sent")
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return Channel(sock, keys.client_key, keys.server_key)

    def _call(self, op: str, *args: bytes, wait_s: float = 0.0) -> list[bytes]:
        with self._lock:
            channel = self._channel
            if channel is None:
                raise dist.DistStoreError(f"fanfold's job store client for {self._where} is closed{self._failed}")
            # bounded even if the server froze: its own answer to a blocking request comes within wait_s
            channel.sock.settimeout(wait_s + 60.0)
            try:
                channel.send(op.encode(), *args)
                status, *values = channel.recv()
            except (OSError, ConnectionError, ValueError, struct.error) as exc:
                # the connection's sequence is lost (an answer late, unread or forged): no later call may use it
                what = ("an answer from the store did not open: something between this process and the store "
                        "tampers with the traffic; " if isinstance(exc, TamperedError) else "")
                self._give_up(f"{op} failed: {what}{exc}")
                raise dist.DistNetworkError(f"fanfold's job store at {self._where}: {op} failed: {what}{exc}") from None
            if status == _ERROR and b"failed authentication" in values[0]:
                self._give_up(f"the store closed it: {values[0].decode()}")
        if status == _TIMEOUT:
            raise dist.DistStoreError(f"fanfold's job store at {self._where}: {op} timed out: {values[0].decode()}")
        if status != _OK:
            raise dist.DistStoreError(f"fanfold's job store at {self._where}: {op}: {values[0].decode()}")
        return values

    def _blocking(self, op: str, keys: Sequence[str], timeout: timedelta | None) -> list[bytes]:
        seconds = (self.timeout if timeout is None else timeout).total_seconds()
        return self._call(op, str(int(seconds * 1000)).encode(), *[_as_bytes(k) for k in keys], wait_s=seconds)

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", _as_bytes(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._blocking("get", [key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._blocking("get", keys, None) if keys else []

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self._call("multi_set", *[_as_bytes(k) for k in keys], *[_as_bytes(v) for v in values])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._blocking("wait", keys, timeout)

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", _as_bytes(key), str(int(value)).encode())[0])

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        return self._call("compare_set", _as_bytes(key), _as_bytes(expected_value), _as_bytes(desired_value))[0]

    def append(self, key: str, value: bytes | str) -> None:
        self._call("append", _as_bytes(key), _as_bytes(value))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", *[_as_bytes(k) for k in keys])[0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", _as_bytes(key))[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call("num_keys")[0])

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> JobStore:  # torch clones a store for a group it splits off
        twin = JobStore(*self._address, self._secret, self.timeout)
        self._clones.append(twin)  # torch keeps only the C++ half of the clone: it lives as long as this store
        return twin

    def _give_up(self, why: str) -> None:
        self._channel.sock.close()
        self._channel, self._failed = None, f" (given up after: {why})"

    def close(self) -> None:  # the store is unusable afterwards: a call that still comes raises DistStoreError
        with self._lock:
            if getattr(self, "_channel", None) is not None:
                self._channel.sock.close()
                self._channel = None

    def __del__(self) -> None:
        # torch's C++ half of this store (a group's PrefixStore, a clone in a writer thread) can still call it from
        # another thread while CPython frees it. Freeing a socket, a clone or the server lets other threads run in
        # the middle of the free, and a call that lands then finds a half-freed object (SIGSEGV). Released here,
        # while the object is whole, a late call gets a DistStoreError, or brings the object back for its duration.
        self.close()
        clones, self._clones = getattr(self, "_clones", []), []
        for twin in clones:
            twin.close()
        del clones
        self.__dict__.pop("_server", None)


def install_env_rendezvous() -> None:
    """Make torch's ``env://`` rendezvous join the job's authenticated store when the environment holds a job
    secret: the launcher's at MASTER_ADDR:MASTER_PORT (``FANFOLD_JOB_STORE=1``), else (torchrun) one rank 0 serves.
    Under torchrun's shared agent store, the ranks meet under a prefix of their round's own (``rounds.py``): a
    restarted round never reads the keys of the round before it. torch's registry entry is swapped for a handler
    that delegates to the one it replaced. Idempotent."""
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module: the package exports a function
    torch_env = rdzv._rendezvous_handlers["env"]
    if getattr(torch_env, "fanfold_job_store", False):
        return

    def env_handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
        secret = job_secret()
        fanfold_store = secret is not None and os.environ.get(STORE_ENV) == "1"
        shared = agent_store_shared() and not fanfold_store
        if secret is None and not shared:
            yield from torch_env(url, timeout=timeout, **kwargs)
            return
        if secret is None:
            torch_store, rank, world_size = next(torch_env(url, timeout=timeout, **kwargs))
            yield round_store(torch_store, rank, world_size, timeout), rank, world_size
            raise RuntimeError("env:// rendezvous in torchrun's shared store cannot be re-run")
        query = dict(pair.split("=", 1) for pair in urlparse(url).query.split("&") if "=" in pair)
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
        world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
        if rank < 0 or world_size < 1:
            raise ValueError(f"env:// rendezvous: RANK={rank} and WORLD_SIZE={world_size} must be set")
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if fanfold_store:
            store = JobStore(addr, port, secret, timeout)
        else:
            # Under torchrun, MASTER_ADDR:MASTER_PORT is torch's TCPStore, open to anyone: it holds only the address
            # of the store rank 0 serves. An impostor who rewrites it makes the ranks refuse to start, never join it.
            bootstrap = rdzv._create_c10d_store(addr, port, rank, world_size, timeout)
            if shared:  # else the store is new every round (rank 0's, at a new port)
                bootstrap = round_store(bootstrap, rank, world_size, timeout)
            key = "fanfold/job_store"
            server = None
            if rank == 0:
                local = addr == "localhost" or addr.startswith("127.")
                server = StoreServer(secret, host="127.0.0.1" if local else "0.0.0.0")
                bootstrap.set(key, f"{'127.0.0.1' if local else socket.getfqdn()}:{server.port}")
            bootstrap.wait([key], timeout)
            host, _, served = bootstrap.get(key).decode().rpartition(":")
            store = JobStore(host, int(served), secret, timeout)
            store._server = server  # rank 0 serves for as long as its store is in use
        try:
            yield store, rank, world_size
        finally:
            # torch drops this generator once init_process_group is done, and keeps the store in C++ only: from
            # here the default group keeps it alive, and closes it when the group is freed (at exit, the OS does).
            # Otherwise (a caller's own `next(dist.rendezvous("env://"))`, or a failed init_process_group) the
            # store closes when its holder lets it go.
            if is_initialized():
                weakref.finalize(dist.group.WORLD, store.close).atexit = False
        raise RuntimeError("env:// rendezvous of fanfold's job store cannot be re-run")

    env_handler.fanfold_job_store = True
    rdzv._rendezvous_handlers["env"] = env_handler
