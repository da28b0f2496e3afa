"""A store connection sealed with the job's secret. The handshake's proofs and the session's keys all come from the
secret and both ends' nonces (HMAC-SHA256, one label each: a client's proof, the server's proof, a key for each
direction), so that a connection's keys are its own and only a holder of the secret has them. Every message after the
handshake is encrypted and authenticated (ChaCha20-Poly1305 from the ``cryptography`` package) under its direction's
key, with its sequence number in that direction as the nonce: whoever relays the bytes reads none of them, and a
message altered, injected, replayed, reordered or following a dropped one fails to open (:class:`TamperedError`).
Threat model: docs/reliability.md."""
from __future__ import annotations

import hmac
import socket
import struct
from dataclasses import dataclass
from hashlib import sha256

HELLO = b"fanfold-store/2\n"
NONCE = 32
PROOF = 32
_TAG = 16  # Poly1305's
_MAX_MESSAGE = 1 << 31  # a length past this is no message of the job's: a relay's invention


class TamperedError(ConnectionError):
    """A sealed message did not open: something between the two ends altered, injected, replayed or reordered
    traffic, or dropped a message before this one."""


@dataclass(frozen=True)
class Handshake:
    """What a connection's handshake derives from the job's secret and both nonces."""

    client_proof: bytes
    server_proof: bytes
    client_key: bytes  # seals what the client sends
    server_key: bytes  # seals what the server sends


def handshake(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> Handshake:
    # The proofs cross the wire in the clear; the keys never do. Each is the secret's HMAC over its own label and the
    # whole greeting, so none can be computed from another, nor carried over from another connection.
    transcript = HELLO + server_nonce + client_nonce

    def derive(label: bytes) -> bytes:
        return hmac.new(secret, b"fanfold-store/2 " + label + b"\0" + transcript, sha256).digest()

    return Handshake(derive(b"client proof"), derive(b"server proof"), derive(b"client->server key"),
                     derive(b"server->client key"))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))  # grows only as bytes arrive, whatever n a relay claims
        if not chunk:
            raise ConnectionError("the store connection was closed by the other end")
        data += chunk
    return bytes(data)


def _encode(fields: tuple[bytes, ...]) -> bytes:
    parts = [struct.pack("!I", len(fields))]
    for f in fields:
        parts += [struct.pack("!I", len(f)), f]
    return b"".join(parts)


def _decode(plain: bytes) -> list[bytes]:
    (n,), at, fields = struct.unpack_from("!I", plain), 4, []
    for _ in range(n):
        (size,) = struct.unpack_from("!I", plain, at)
        fields.append(plain[at + 4:at + 4 + size])
        at += 4 + size
    if at != len(plain):
        raise ValueError(f"a store message of {len(plain)} bytes holds {at}")
    return fields


class Channel:
    """``sock`` after the handshake: messages (lists of byte strings) sent sealed with ``send_key`` and opened with
    ``recv_key``, each with its sequence number in its direction. Not thread-safe: one sender and one receiver."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
        cipher = self.cipher()
        self.sock = sock
        self._seal, self._open = cipher(send_key), cipher(recv_key)
        self._sent = self._received = 0

    @staticmethod
    def cipher() -> type:
        # imported on first use (tens of ms): `import fanfold` stays free of it until a store is served or joined
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

        return ChaCha20Poly1305

    @staticmethod
    def _nonce(sequence: int) -> bytes:
        return b"\0\0\0\0" + sequence.to_bytes(8, "big")  # each key is one direction's: a nonce never repeats

    def send(self, *fields: bytes) -> None:
        plain = _encode(fields)
        header = struct.pack("!I", len(plain) + _TAG)  # the length in the clear, and authenticated
        self.sock.sendall(header + self._seal.encrypt(self._nonce(self._sent), plain, header))
        self._sent += 1

    def recv(self) -> list[bytes]:
        from cryptography.exceptions import InvalidTag

        header = recv_exact(self.sock, 4)
        (n,) = struct.unpack("!I", header)
        if not _TAG <= n <= _MAX_MESSAGE:
            raise TamperedError(f"message {self._received} on this connection claims {n} bytes: not sealed by the "
                                f"other end")
        body = recv_exact(self.sock, n)
        try:
            plain = self._open.decrypt(self._nonce(self._received), body, header)
        except InvalidTag:
            raise TamperedError(f"message {self._received} on this connection failed authentication: it was altered, "
                                f"injected, replayed or reordered on the way, or one before it was dropped") from None
        self._received += 1
        return _decode(plain)
