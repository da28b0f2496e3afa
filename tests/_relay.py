"""A relay between store clients and a store server, for the relay tests (tests/launcher/test_store_relay.py and
tests/multihost/test_relay_across_hosts.py). :class:`Relay` starts it as a process of its own, as user `nobody`
where this run is root and `nobody` can run a Python; run as a program it accepts connections, opens one to the
target for each, logs every chunk each way and forwards it, unless told to hold, flip, replay or inject. Standard
library only: `nobody` runs this file's text (``python -I -c``) with nothing of the checkout on its path.

    python _relay.py TARGET_HOST TARGET_PORT [LISTEN_HOST]

TARGET_HOST ``-``: the target comes later, by the command ``target - HOST:PORT``; connections made before it wait.
On stdin one command per line (``CMD WAY [ARG]``, WAY ``c2s`` or ``s2c``; the commands act on the latest
connection), on stdout one JSON line per answer; the first line says the listening port and the relay's uid.
"""
import functools
import json
import os
import pwd
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time


@functools.cache
def runner() -> tuple[str, dict, str]:
    """(an interpreter, Popen's arguments, why not as `nobody`: "" when it is): the relay runs as `nobody` where this
    run is root and `nobody` can run a Python (this checkout's may lie under a directory closed to others)."""
    if os.geteuid() != 0:
        return sys.executable, {}, "this run is not root, so it cannot switch to user `nobody`"
    nobody = pwd.getpwnam("nobody")
    as_nobody = dict(user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[])
    for python in dict.fromkeys([sys.executable, os.path.realpath(sys.executable), shutil.which("python3") or "",
                                 "/usr/bin/python3"]):
        try:
            if python and subprocess.run([python, "-I", "-c", "pass"], cwd="/", capture_output=True, timeout=60,
                                         **as_nobody).returncode == 0:
                return python, as_nobody, ""
        except OSError:  # the exec itself refused: a directory on its path is closed to others
            pass
    return sys.executable, {}, "no Python interpreter on this machine is executable by user `nobody`"


class Relay:
    """The relay process, between clients that connect to :attr:`port` (on ``listen``) and the server at
    ``host:port`` (``host`` "-": given later with :meth:`target`)."""

    def __init__(self, port: int, host: str = "127.0.0.1", listen: str = "127.0.0.1"):
        python, as_nobody, _ = runner()
        with open(__file__) as f:
            program = f.read()
        self.proc = subprocess.Popen([python, "-I", "-c", program, host, str(port), listen], cwd="/",
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **as_nobody)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        first = self._answer()
        self.port, self.uid = first["port"], first["uid"]

    def _read(self):
        for line in self.proc.stdout:
            self._lines.put(line)

    def _answer(self) -> dict:
        try:
            return json.loads(self._lines.get(timeout=30))
        except queue.Empty:
            raise AssertionError(f"the relay did not answer within 30 s (exit code {self.proc.poll()})") from None

    def __call__(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def target(self, address: str) -> None:
        """Where the connections go (``HOST:PORT``), for a relay started without one."""
        self(f"target - {address}")

    def seen(self) -> bytes:
        log = self("log -")
        return bytes.fromhex(log["c2s"]) + bytes.fromhex(log["s2c"])

    def connections(self) -> int:
        return self("log -")["connections"]

    def held(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while self("count c2s")["held"] < n:
            assert time.monotonic() < deadline, f"the relay did not receive message {n} within 10 s"
            time.sleep(0.01)

    def close(self):
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait(timeout=10)


def _serve(argv: list[str]) -> None:
    state = {"target": None if argv[0] == "-" else (argv[0], int(argv[1])), "connections": 0}
    target_known = threading.Event()
    if state["target"] is not None:
        target_known.set()
    listener = socket.create_server((argv[2] if len(argv) > 2 else "127.0.0.1", 0))
    lock = threading.Lock()
    log = {"c2s": bytearray(), "s2c": bytearray()}
    chunks = {"c2s": [], "s2c": []}
    mark = {"c2s": 0, "s2c": 0}
    held = {"c2s": None, "s2c": None}
    flip = {"c2s": False, "s2c": False}
    ends = {}

    def pump(src, dst, way):
        while True:
            try:
                chunk = src.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            with lock:
                log[way] += chunk
                chunks[way].append(chunk)
                if flip[way]:
                    chunk, flip[way] = chunk[:-1] + bytes([chunk[-1] ^ 1]), False
                if held[way] is not None:
                    held[way].append(chunk)
                    continue
                try:  # under the lock: a release's held chunks go before the ones that come after it
                    dst.sendall(chunk)
                except OSError:
                    return

    def connect(down):
        target_known.wait()
        up = socket.create_connection(state["target"], timeout=10)
        up.settimeout(None)
        for s in (down, up):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with lock:
            ends.update(c2s=up, s2c=down)
            state["connections"] += 1
        threading.Thread(target=pump, args=(down, up, "c2s"), daemon=True).start()
        threading.Thread(target=pump, args=(up, down, "s2c"), daemon=True).start()

    def accept():
        while True:
            down, _ = listener.accept()
            threading.Thread(target=connect, args=(down,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(json.dumps({"port": listener.getsockname()[1], "uid": os.geteuid()}), flush=True)
    for line in sys.stdin:
        cmd, way, *rest = line.split()
        answer = {}
        with lock:
            if cmd == "log":
                answer = {"connections": state["connections"], **{w: log[w].hex() for w in log}}
            elif cmd == "target":
                host, _, port = rest[0].rpartition(":")
                state["target"] = (host, int(port))
                target_known.set()
            elif cmd == "mark":
                mark[way] = len(chunks[way])
            elif cmd == "replay":
                for chunk in chunks[way][mark[way]:]:
                    ends[way].sendall(chunk)
            elif cmd == "inject":
                ends[way].sendall(bytes.fromhex(rest[0]))
            elif cmd == "flip":
                flip[way] = True
            elif cmd == "hold":
                held[way] = []
            elif cmd == "count":
                answer = {"held": len(held[way])}
            elif cmd == "release":
                for i in map(int, rest[0].split(",")):
                    ends[way].sendall(held[way][i])
                held[way] = None
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1:])
