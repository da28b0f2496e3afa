"""The job this process belongs to: its rank and world size, and its rendezvous store: a key-value server admitting
only processes that prove the job's secret (HMAC-SHA256 both ways; ``FANFOLD_JOB_SECRET`` or a 0600 file named by
``FANFOLD_JOB_SECRET_FILE``) and its client, a ``torch.distributed.Store``. Threat model: docs/reliability.md."""
from __future__ import annotations

import contextlib
import hmac
import importlib
import os
import secrets
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from hashlib import sha256
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from .rounds import agent_store_shared, round_store

SECRET_ENV = "FANFOLD_JOB_SECRET"
SECRET_FILE_ENV = "FANFOLD_JOB_SECRET_FILE"
STORE_ENV = "FANFOLD_JOB_STORE"  # "1": MASTER_ADDR:MASTER_PORT is a StoreServer (fanfold's launchers set it)

_HELLO = b"fanfold-store/1\n"
_NONCE = 32
_DIGEST = 32
_HANDSHAKE_S = 10.0  # a connection that has not proved the secret by then is closed
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


def job_secret() -> bytes | None:
    """The job's secret from ``FANFOLD_JOB_SECRET``, else the stripped content of the file named by
    ``FANFOLD_JOB_SECRET_FILE``, which must be a regular file of this user closed to others (PermissionError
    otherwise); None when neither is set."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return value.encode()
    path = os.environ.get(SECRET_FILE_ENV)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PermissionError(f"{SECRET_FILE_ENV}={path!r} cannot be opened: {exc.strerror} (a symbolic link is "
                              f"refused: name the file itself)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{SECRET_FILE_ENV}={path!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{SECRET_FILE_ENV}={path!r} belongs to uid {st.st_uid}, not to this job's user "
                                  f"(uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise PermissionError(f"{SECRET_FILE_ENV}={path!r} has mode {stat.S_IMODE(st.st_mode):04o}: other users "
                                  f"may read or write it; make it readable by its owner only: chmod 600 {path}")
        data = os.read(fd, 1 << 20).strip()  # a regular file: read whole unless it is larger (no secret is)
    finally:
        os.close(fd)
    if not data:
        raise PermissionError(f"{SECRET_FILE_ENV}={path!r} is empty")
    return data


def _proof(secret: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    # "side" keeps a client's proof from being replayed as the server's, and the reverse
    return hmac.new(secret, b"fanfold-store " + side + server_nonce + client_nonce, sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the store connection was closed by the other end")
        data += chunk
    return bytes(data)


def _send(sock: socket.socket, *fields: bytes) -> None:
    parts = [struct.pack("!I", len(fields))]
    for f in fields:
        parts += [struct.pack("!I", len(f)), f]
    sock.sendall(b"".join(parts))


def _recv(sock: socket.socket) -> list[bytes]:
    # read only from a peer that proved the secret: the job's own processes
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return [_recv_exact(sock, struct.unpack("!I", _recv_exact(sock, 4))[0]) for _ in range(n)]


class StoreServer:
    """Serves one job's keys on ``host`` (a free port) to clients that prove ``secret``. One thread accepting, one
    per connection."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1"):
        self._secret = secret
        self._sock = socket.create_server((host, 0), backlog=128)
        self.host, self.port = self._sock.getsockname()[:2]
        self._store = dist.HashStore()  # a TCPStore's semantics; its waits release the GIL
        self._conns: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name=f"fanfold-store-{self.port}", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for s in [self._sock, *list(self._conns)]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> bool:
        conn.settimeout(_HANDSHAKE_S)
        server_nonce = secrets.token_bytes(_NONCE)
        conn.sendall(_HELLO + server_nonce)
        reply = _recv_exact(conn, _NONCE + _DIGEST)
        client_nonce, proof = reply[:_NONCE], reply[_NONCE:]
        if not hmac.compare_digest(proof, _proof(self._secret, b"client", server_nonce, client_nonce)):
            return False
        conn.sendall(_proof(self._secret, b"server", server_nonce, client_nonce))
        conn.settimeout(None)  # an admitted client may stay idle for the whole job
        return True

    def _serve(self, conn: socket.socket) -> None:
        try:
            admitted = self._admit(conn)
            while admitted and not self._closed:
                request = _recv(conn)
                try:
                    answer = self._answer(request[0].decode(), request[1:])
                except (IndexError, TypeError, ValueError, UnicodeDecodeError) as exc:  # malformed: say so, go on
                    answer = [_ERROR, f"malformed store request: {type(exc).__name__}: {exc}".encode()]
                _send(conn, *answer)
        except (OSError, ConnectionError, struct.error):
            pass  # the client went away (or never proved the secret in time)
        finally:
            self._conns.discard(conn)
            conn.close()

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
        self._sock = self._connect(host, port, secret, timeout.total_seconds())

    def _connect(self, host: str, port: int, secret: bytes, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=_HANDSHAKE_S)
                break
            except OSError as exc:  # nothing listens yet (refused, unreachable, timed out)
                if time.monotonic() + delay > deadline:
                    raise dist.DistStoreError(f"fanfold's job store at {self._where} did not answer within "
                                              f"{timeout:g} s: {exc}") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _recv_exact(sock, len(_HELLO) + _NONCE)
            if not hello.startswith(_HELLO):
                raise AuthenticationError(f"{self._where} is not fanfold's job store (it greeted with {hello[:16]!r})")
            server_nonce, client_nonce = hello[len(_HELLO):], secrets.token_bytes(_NONCE)
            sock.sendall(client_nonce + _proof(secret, b"client", server_nonce, client_nonce))
            try:
                answer = _recv_exact(sock, _DIGEST)
            except ConnectionError:
                raise AuthenticationError(
                    f"fanfold's job store at {self._where} refused this process: its secret is not this job's "
                    f"(check {SECRET_ENV} / {SECRET_FILE_ENV} on every node)") from None
            if not hmac.compare_digest(answer, _proof(secret, b"server", server_nonce, client_nonce)):
                raise AuthenticationError(f"the store at {self._where} could not prove the job's secret: not this "
                                          f"job's store (another process may have taken its port); nothing sent")
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock

    def _call(self, op: str, *args: bytes, wait_s: float = 0.0) -> list[bytes]:
        with self._lock:
            if self._sock is None:
                raise dist.DistStoreError(f"fanfold's job store client for {self._where} is closed")
            # bounded even if the server froze: its own answer to a blocking request comes within wait_s
            self._sock.settimeout(wait_s + 60.0)
            try:
                _send(self._sock, op.encode(), *args)
                status, *values = _recv(self._sock)
            except (OSError, ConnectionError) as exc:
                raise dist.DistNetworkError(f"fanfold's job store at {self._where}: {op} failed: {exc}") from None
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

    def close(self) -> None:  # the store is unusable afterwards: a call that still comes raises DistStoreError
        with self._lock:
            if getattr(self, "_sock", None) is not None:
                self._sock.close()
                self._sock = None

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
