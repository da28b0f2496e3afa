"""A relay between a rank and the job's store, as in the attack where another local user rewrote the store's address
in torchrun's open store and passed each rank's bytes on to the real one: the relay (user `nobody` when this run is
root) forwards the handshake, so the connection is made, and then reads what crosses, injects a request of its own,
replays one, flips a bit of a request or of an answer, drops or reorders messages. Against the job's store it reads
none of the job's keys or values, and each alteration makes the client or the store raise, naming it, with nothing
of it applied. Positive control: the same relay against torch's TCPStore (no authentication) reads the values and
gets its replay and its altered request applied, so the relay itself works."""
import pwd
import secrets
import socket
import struct
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from _relay import Relay, runner
from fanfold._core.job import JobStore, StoreServer

T = timedelta(seconds=20)
SECRET = secrets.token_hex(32).encode()


@pytest.fixture
def job():
    """The job's store, a relay in front of it, a client of the job through the relay and one that is not."""
    server = StoreServer(SECRET)
    relay = Relay(server.port)
    relayed = JobStore("127.0.0.1", relay.port, SECRET, T)
    direct = JobStore("127.0.0.1", server.port, SECRET, T)
    yield relay, relayed, direct
    for closing in (relayed.close, direct.close, relay.close, server.close):
        closing()


@pytest.fixture
def bare():
    """The same for torch's TCPStore: the positive control."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    relay = Relay(server.port)
    relayed = dist.TCPStore("127.0.0.1", relay.port, is_master=False, timeout=T)
    yield relay, relayed, server
    del relayed
    relay.close()


def _eventually(read, expected, within=10.0):
    """``read()`` once it equals ``expected``, else its last value after ``within`` s (the relayed bytes are on
    their way)."""
    deadline = time.monotonic() + within
    while (got := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_the_relay_runs_as_another_user(job):
    why_not = runner()[2]
    if why_not:
        pytest.skip(f"the relay runs as this run's own user: {why_not}")
    relay, _, _ = job
    assert relay.uid == pwd.getpwnam("nobody").pw_uid


def test_a_relay_that_only_forwards_is_a_pipe_and_reads_nothing(job, bare):
    key, value = f"canary/key-{secrets.token_hex(4)}", f"canary-value-{secrets.token_hex(8)}"
    relay, relayed, direct = job
    relayed.set(key, value)
    assert relayed.get(key) == direct.get(key) == value.encode()  # the job works through the relay
    assert relayed.add("n", 3) == 3 and direct.add("n", 4) == 7
    seen = relay.seen()
    assert len(seen) > 200  # the relay did carry the traffic: handshake, three requests, three answers
    for plain in (key, value, "canary", "add", SECRET.decode()):
        assert plain.encode() not in seen, f"the relay read {plain!r}"

    control, control_client, _ = bare
    control_client.set(key, value)
    assert control_client.get(key) == value.encode()
    assert value.encode() in control.seen() and key.encode() in control.seen()


def _old_frame(*fields: bytes) -> bytes:
    # a request as it travelled unsealed: a field count, then each field's length and bytes
    return struct.pack("!I", len(fields)) + b"".join(struct.pack("!I", len(f)) + f for f in fields)


TAMPERED = r"failed authentication|did not open|tampers"


def test_a_request_injected_after_the_handshake_is_refused_and_not_applied(job):
    relay, relayed, direct = job
    relayed.set("a", "1")
    relay("inject c2s " + _old_frame(b"set", b"attacker/was-here", b"yes").hex())
    with pytest.raises((dist.DistStoreError, dist.DistNetworkError), match=TAMPERED):
        relayed.get("a")
    assert not direct.check(["attacker/was-here"])
    with pytest.raises(dist.DistStoreError, match="closed .*given up"):  # the broken connection is not used again
        relayed.get("a")


def test_a_replayed_request_is_refused_and_not_applied(job, bare):
    relay, relayed, direct = job
    relay("mark c2s")
    assert relayed.add("n", 5) == 5
    relay("replay c2s")
    with pytest.raises((dist.DistStoreError, dist.DistNetworkError), match=TAMPERED):
        relayed.get("n")
    assert direct.add("n", 0) == 5

    control, control_client, server = bare
    control("mark c2s")
    assert control_client.add("n", 5) == 5
    control("replay c2s")
    assert _eventually(lambda: server.add("n", 0), 10) == 10  # applied twice


def test_an_altered_request_is_refused_and_not_applied(job, bare):
    relay, relayed, direct = job
    relay("flip c2s")
    with pytest.raises(dist.DistStoreError, match=TAMPERED):
        relayed.set("b", "value")
    assert not direct.check(["b"])

    control, control_client, server = bare
    control("flip c2s")
    control_client.set("b", "value")  # its last byte flipped on the way: the value's
    assert server.get("b") == b"valud"


def test_an_altered_answer_is_refused(job):
    relay, relayed, direct = job
    relayed.set("c", "hello")
    relay("flip s2c")
    with pytest.raises(dist.DistNetworkError, match=TAMPERED):
        relayed.get("c")
    assert direct.get("c") == b"hello"


@pytest.mark.parametrize("order", ["0,1,2", "1,2", "1,0,2", "0,0,1"], ids=["in-order", "drop", "reorder", "replay"])
def test_a_dropped_or_reordered_message_does_not_open(order):
    """The channel itself, one side sending three messages in a row (the store's requests wait for their answers,
    so a store connection never has two in flight): only the order they were sent in opens."""
    from fanfold._core.channel import Channel, TamperedError, handshake

    listener = socket.create_server(("127.0.0.1", 0))
    relay = Relay(listener.getsockname()[1])
    try:
        client = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
        server, _ = listener.accept()
        server.settimeout(10)
        keys = handshake(SECRET, secrets.token_bytes(32), secrets.token_bytes(32))
        sender = Channel(client, keys.client_key, keys.server_key)
        receiver = Channel(server, keys.server_key, keys.client_key)
        relay("hold c2s")
        for i in range(3):
            sender.send(b"message", str(i).encode())
            relay.held(i + 1)
        relay(f"release c2s {order}")
        delivered = [int(i) for i in order.split(",")]
        for n, sent in enumerate(delivered):
            if sent != n:  # the first message out of its place: it does not open, nor does anything after it
                with pytest.raises(TamperedError, match=f"message {n} on this connection failed authentication"):
                    receiver.recv()
                break
            assert receiver.recv() == [b"message", str(n).encode()]
        else:
            assert delivered == [0, 1, 2]
        assert b"message" not in relay.seen()
        client.close()
        server.close()
    finally:
        relay.close()
        listener.close()
