"""The job's store against abuse from outside the job: a flood of idle connections at a lowered handle limit, a run
of wrong guesses, a weak user-chosen secret, a secret path that is not a regular file. The oracle each time is what
the job's own client (the right secret) gets: in, within a bound, with the same answers as ever."""
import logging
import os
import re
import secrets
import socket
import stat
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from fanfold._core.job import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    AuthenticationError,
    JobStore,
    StoreServer,
    job_secret,
)

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
SECRET = secrets.token_hex(32).encode()

_FLOODED = r"""
import os, resource, sys
sys.path.insert(0, sys.argv[1])
from fanfold._core.job import StoreServer
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
server = StoreServer(sys.argv[2].encode())
held = []  # all the handles but a few: the flood meets EMFILE before the server's own caps
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
for fd in held[:int(sys.argv[3])]:
    os.close(fd)
print(server.port, flush=True)
sys.stdin.read()  # serve until the test closes our stdin
"""


def _served_within(port, bound):
    """A client of the job: connect, set, get; the seconds it took, or an AssertionError past ``bound``."""
    t0 = time.monotonic()
    store = JobStore("127.0.0.1", port, SECRET, timedelta(seconds=bound))
    key = f"k{secrets.token_hex(4)}"
    store.set(key, b"v")
    assert store.get(key) == b"v"
    took = time.monotonic() - t0
    assert took < bound, took
    return store, took


@pytest.mark.parametrize("spare", [6, 40], ids=["out-of-handles", "at-the-caps"])
def test_a_flood_of_idle_connections_at_a_lowered_handle_limit_keeps_the_job_served(spare):
    server = subprocess.Popen([sys.executable, "-c", _FLOODED, SRC, SECRET.decode(), str(spare)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    flood = []
    try:
        port = int(server.stdout.readline())
        first, _ = _served_within(port, 20)  # a client of the job, in before the flood
        for _ in range(200):  # several times the server's 64 handles, from the same address as the job's clients
            s = socket.socket()
            s.settimeout(1)
            flood.append(s)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:  # the backlog is full: the kernel drops the connection; it stays in the count
                pass
        during, took = _served_within(port, 20)
        first.set("still", b"here")
        assert during.get("still") == b"here"  # the connection admitted before the flood still works
        for s in flood:
            s.close()
        flood.clear()
        after, _ = _served_within(port, 20)
        assert after.get("still") == b"here" and server.poll() is None
    finally:
        for s in flood:
            s.close()
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


def test_wrong_guesses_are_slowed_and_logged_once_by_source_and_the_job_still_gets_in(caplog):
    server = StoreServer(SECRET)
    try:
        with caplog.at_level(logging.WARNING, logger="fanfold._core.job"):
            took = []
            for _ in range(10):
                t0 = time.monotonic()
                with pytest.raises(AuthenticationError, match="refused this process"):
                    JobStore("127.0.0.1", server.port, secrets.token_hex(32).encode(), timedelta(seconds=30))
                took.append(time.monotonic() - t0)
            # past 5 failures, each guess waits for its greeting: 0.25, 0.5, 1, 2 s
            assert sum(took[6:]) >= 3.5, took
            _, seconds = _served_within(server.port, 10)  # the right secret, from the same address, still gets in
        lines = [r.getMessage() for r in caplog.records if r.name == "fanfold._core.job"]
        assert len(lines) == 1 and "127.0.0.1 failed the handshake" in lines[0], lines  # once, not per guess
    finally:
        server.close()


@pytest.fixture
def secret_env(monkeypatch):
    def secret_with(**env):
        monkeypatch.delenv(SECRET_ENV, raising=False)
        monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return job_secret()

    return secret_with


@pytest.mark.parametrize("weak", ["7391", "0123456789abcdef0123456789abcde", "ab" * 20])
def test_a_weak_secret_is_refused_saying_how_to_make_one(secret_env, tmp_path, weak):
    with pytest.raises(PermissionError, match=r"FANFOLD_JOB_SECRET is too weak .*`fanfold secret`"):
        secret_env(FANFOLD_JOB_SECRET=weak)
    path = tmp_path / "secret"
    path.write_text(weak + "\n")
    path.chmod(0o600)
    with pytest.raises(PermissionError, match=r"secret in FANFOLD_JOB_SECRET_FILE=.* is too weak .*fanfold secret"):
        secret_env(FANFOLD_JOB_SECRET_FILE=str(path))


def test_a_strong_secret_is_accepted_and_fanfold_secret_makes_one(secret_env, tmp_path):
    hex32 = secrets.token_hex(16)  # 128 bits: the least accepted
    assert secret_env(FANFOLD_JOB_SECRET=hex32) == hex32.encode()
    env = {**os.environ, "PYTHONPATH": SRC}
    printed = subprocess.run([sys.executable, "-m", "fanfold", "secret"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert printed.returncode == 0 and re.fullmatch(r"[0-9a-f]{64}\n", printed.stdout), printed
    assert secret_env(FANFOLD_JOB_SECRET=printed.stdout.strip()) == printed.stdout.strip().encode()
    path = tmp_path / "job-secret"
    written = subprocess.run([sys.executable, "-m", "fanfold", "secret", "--file", str(path)], env=env,
                             capture_output=True, text=True, timeout=120)
    assert written.returncode == 0, written.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(secret_env(FANFOLD_JOB_SECRET_FILE=str(path))) == 64
    again = subprocess.run([sys.executable, "-m", "fanfold", "secret", "--file", str(path)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "must not exist yet" in again.stderr  # never overwritten


def _fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path, 0o600)
    return path


def _unblock(path):
    # a reader stuck in open() on the FIFO (a failing run of this test) is released by a writer
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_secret_path_that_is_not_a_regular_file_is_refused_at_once(secret_env, tmp_path):
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "sock"))
    fifo = _fifo(tmp_path)
    cases = {fifo: "a FIFO (named pipe)", "/dev/zero": "a character device", tmp_path: "a directory",
             tmp_path / "sock": "a socket"}
    try:
        for path, kind in cases.items():
            result = []

            def read(path=path):
                try:
                    secret_env(FANFOLD_JOB_SECRET_FILE=str(path))
                except PermissionError as exc:
                    result.append(str(exc))

            reader = threading.Thread(target=read, daemon=True)
            t0 = time.monotonic()
            reader.start()
            reader.join(timeout=5)
            _unblock(fifo)
            reader.join(timeout=5)
            assert time.monotonic() - t0 < 1 and result, (path, result)
            assert f"FANFOLD_JOB_SECRET_FILE={str(path)!r} is {kind}, not a regular file" in result[0]
    finally:
        _unblock(fifo)
        listener.close()


@pytest.mark.parametrize("how", ["weak", "fifo"])
def test_fanfold_run_refuses_a_weak_secret_or_a_fifo_before_starting_a_worker(tmp_path, how):
    script = tmp_path / "job.py"
    marker = tmp_path / "started"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FANFOLD_JOB_")}
    env["PYTHONPATH"] = SRC
    if how == "weak":
        env[SECRET_ENV] = "7391"
    else:
        env[SECRET_FILE_ENV] = str(_fifo(tmp_path))
    try:
        done = subprocess.run([sys.executable, "-m", "fanfold", "run", "-n", "2", str(script)], env=env,
                              capture_output=True, text=True, timeout=90)
    finally:
        if how == "fifo":
            _unblock(tmp_path / "fifo")
    assert done.returncode == 2, done.stderr[-3000:]
    assert ("too weak" if how == "weak" else "is a FIFO") in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists()
