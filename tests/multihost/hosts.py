"""Simulated hosts on one Linux machine: :class:`Hosts` makes N of them out of namespaces (root only).

Each host is a network namespace of its own (``ip netns``), entered by a long-lived init process that holds the
host's mount namespace (a private tmpfs on /dev/shm, its own /etc/hosts), UTS namespace (hostname ``h0``, ``h1``,
...) and PID namespace; every process started "in host h" joins all four (``nsenter``), so the ranks of one host
share its /dev/shm and hostname, and the ranks of different hosts share neither. Two hosts are linked by one veth
pair; more by a bridge in a namespace of its own. Addresses come from the benchmarking range 198.18.0.0/15
(``198.18.0.<h+1>``). With a :class:`Link`, every veth end is shaped by ``tc tbf`` (each way: the host's end shapes
what it sends, the other end what it receives). The rest of the file system is shared, as over NFS.

Names carry this process's pid (``ffh<pid>...``), so concurrent runs do not collide, and a new :class:`Hosts` first
removes those left by runs that were killed. ``close`` (the context manager's exit, and atexit) kills every process
of the hosts and removes every namespace and veth; the init processes also exit, taking their hosts' processes
with them, when the process that made them dies (they read a pipe whose other end it holds).

Used by the tests of ``tests/multihost`` and by ``benchmarks/multihost.py``.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Hosts", "Link", "Rank", "unavailable", "wait_ranks", "PREFIX"]

PREFIX = "ffh"  # every namespace and link name of this harness starts with it, then the creating process's pid
_NAME = re.compile(rf"^{PREFIX}(\d+)[a-z]")
_TOOLS = ("ip", "tc", "unshare", "nsenter", "mount")


@dataclass(frozen=True)
class Link:
    """``tc tbf`` parameters of each direction of each host's link: ``rate`` (bits/s, tc's units: "1gbit"), ``burst``
    (bucket size in bytes: "256kb", at least rate / HZ) and ``latency`` (the longest a packet may wait in the queue
    before it is dropped: "50ms")."""

    rate: str = "1gbit"
    burst: str = "256kb"
    latency: str = "50ms"


@dataclass
class Rank:
    """One process started by :meth:`Hosts.start_ranks`: its global ``rank``, ``host``, the process, its log."""

    rank: int
    host: int
    proc: subprocess.Popen
    log: str

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


def wait_ranks(ranks: Sequence[Rank], timeout: float, may_fail: Sequence[int] = ()) -> None:
    """Wait for every rank to exit, at most ``timeout`` seconds in all; RuntimeError naming the ranks that failed
    (but those of ``may_fail``) or were still running (then killed: the caller's :class:`Hosts` removes what is
    left), with their output."""
    deadline = time.monotonic() + timeout
    late = []
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(r)
    for r in late:
        r.proc.kill()
        r.proc.wait()
    failed = [r for r in ranks if r not in late and r.proc.returncode != 0 and r.rank not in may_fail]
    if late or failed:
        report = [f"rank {r.rank} (host {r.host}): " + ("still running after the timeout" if r in late else
                  f"exit code {r.proc.returncode}") + "\n" + r.output()[-3000:] for r in late + failed]
        raise RuntimeError(f"{len(late + failed)} of {len(ranks)} ranks failed or timed out ({timeout:g} s):\n"
                           + "\n".join(report))


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here (a reason to skip), or None when they can."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "needs Linux namespaces"
    if os.geteuid() != 0:
        return "needs root (network, mount and PID namespaces; veth links; tc)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} on PATH"
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces and links of this harness whose creating process is gone; return their names."""
    removed = []
    names = _sh("ip", "netns", "list", check=False).stdout.split()
    links = [m.group(1).split("@")[0] for m in re.finditer(r"^\d+: ([^:]+):", _sh("ip", "-o", "link", "show").stdout,
                                                            re.M)]
    for name in [n for n in names if _NAME.match(n)] + [n for n in links if _NAME.match(n)]:
        if _alive(int(_NAME.match(name).group(1))):
            continue
        kind = "netns" if name in names else "link"
        if kind == "netns":
            # pids of the namespace (a stale init, its ranks) first: a netns with processes outlives its name
            for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "del", name, check=False)
        else:
            _sh("ip", "link", "del", name, check=False)
        removed.append(name)
    return removed


class Hosts:
    """``n`` simulated hosts (root only; see the module docstring). Use as a context manager::

        with Hosts(2, link=Link("1gbit")) as hosts:
            p = hosts.popen(0, [sys.executable, "-c", "import socket; print(socket.gethostname())"])

    ``shm_size`` is the size of each host's /dev/shm tmpfs (mount's syntax).
    """

    def __init__(self, n: int, *, link: Link | None = None, shm_size: str = "1g"):
        if n < 1:
            raise ValueError(f"n (hosts) must be >= 1, got {n}")
        if n > 250:
            raise ValueError(f"n (hosts) must be at most 250 (one /24 of 198.18.0.0/15), got {n}")
        reason = unavailable()
        if reason:
            raise RuntimeError(f"simulated hosts: {reason}")
        self.n, self.link, self.shm_size = n, link, shm_size
        tag = f"{PREFIX}{os.getpid()}"
        self.netns = [f"{tag}h{h}" for h in range(n)]
        self._switch = f"{tag}s" if n > 2 else None
        # the device of host h, and the far end of its link (host 1's device for 2 hosts, else the bridge's port)
        self.devices = [f"{tag}v{h}" for h in range(n)]
        self._ports = [f"{tag}p{h}" for h in range(n)] if n > 2 else list(reversed(self.devices))
        self._inits: list[subprocess.Popen] = []
        self._init_pids: list[int] = []
        self._procs: list[subprocess.Popen] = []
        self._etc = tempfile.mkdtemp(prefix=f"{tag}-etc-")
        self._closed = False
        atexit.register(self.close)

    # -- set-up and tear-down --------------------------------------------------------------------------------------
    def __enter__(self) -> Hosts:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        remove_stale()
        for ns in self.netns + ([self._switch] if self._switch else []):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if self.n == 2:
            _sh("ip", "link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
            for h in range(2):
                _sh("ip", "link", "set", self.devices[h], "netns", self.netns[h])
        elif self.n > 2:
            _sh("ip", "-n", self._switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self._switch, "link", "set", "br0", "up")
            for h in range(self.n):
                _sh("ip", "link", "add", self.devices[h], "type", "veth", "peer", "name", self._ports[h])
                _sh("ip", "link", "set", self.devices[h], "netns", self.netns[h])
                _sh("ip", "link", "set", self._ports[h], "netns", self._switch)
                _sh("ip", "-n", self._switch, "link", "set", self._ports[h], "master", "br0")
                _sh("ip", "-n", self._switch, "link", "set", self._ports[h], "up")
        for ns in self.netns + ([self._switch] if self._switch else []):
            # no IPv6: its neighbour discovery and router solicitations would add to the links' idle counters
            _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1")
        for h in range(self.n if self.n > 1 else 0):
            _sh("ip", "-n", self.netns[h], "addr", "add", f"{self.addr(h)}/24", "dev", self.devices[h])
            _sh("ip", "-n", self.netns[h], "link", "set", self.devices[h], "up")
        if self.link is not None and self.n > 1:
            ends = [(self.netns[h], self.devices[h]) for h in range(self.n)]
            ends += [(self._switch or self.netns[1 - h], self._ports[h]) for h in range(self.n)] if self.n > 2 else []
            for ns, dev in ends:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.link.rate,
                    "burst", self.link.burst, "latency", self.link.latency)
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{self.addr(h)} h{h}\n" for h in range(self.n))
        for h in range(self.n):
            path = os.path.join(self._etc, f"hosts{h}")
            with open(path, "w") as f:
                f.write(hosts_file)
            self._start_init(h, path)

    def _start_init(self, h: int, hosts_path: str) -> None:
        # PID 1 of the host's PID namespace is `cat` on a pipe from this process: it exits at EOF (this process
        # gone), and the kernel then kills every process of the namespace. /proc is remounted for the namespace.
        setup = (f"mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm && "
                 f"mount --bind {hosts_path} /etc/hosts && hostname h{h} && echo ready && exec cat >/dev/null")
        init = subprocess.Popen(
            ["ip", "netns", "exec", self.netns[h], "unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
             "--kill-child", "sh", "-c", setup],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._inits.append(init)
        line = init.stdout.readline()
        if line.strip() != "ready":
            why = init.stderr.read() if init.poll() is not None else ""
            raise RuntimeError(f"host {h}: its init failed to set up: {line}{why}")
        # `ip netns exec` execs unshare (same pid); unshare forks PID 1 of the new namespace: its only child
        with open(f"/proc/{init.pid}/task/{init.pid}/children") as f:
            self._init_pids.append(int(f.read().split()[0]))

    def close(self) -> None:
        """Kill every process of the hosts; remove every namespace and link. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for pid in self._init_pids:  # PID 1 of a namespace: its death kills the namespace's every process
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self._procs + self._inits:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        for ns in self.netns + ([self._switch] if self._switch else []):
            _sh("ip", "netns", "del", ns, check=False)  # its veth ends go with it, and so their peers
        for dev in self.devices:
            _sh("ip", "link", "del", dev, check=False)  # made but never moved (a failed start)
        shutil.rmtree(self._etc, ignore_errors=True)
        atexit.unregister(self.close)

    # -- use -------------------------------------------------------------------------------------------------------
    def addr(self, h: int) -> str:
        """Host ``h``'s address (on its link; also what its hostname ``h<h>`` resolves to on every host)."""
        return f"198.18.0.{self._check(h) + 1}"

    def command(self, h: int, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` prefixed with what enters host ``h`` (its net, mount, UTS and PID namespaces), in ``cwd``."""
        return ["nsenter", "-t", str(self._init_pids[self._check(h)]), "--net", "--mount", "--uts", "--pid",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def popen(self, h: int, argv: Sequence[str], *, cwd: str | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` in host ``h``; ``kwargs`` go to ``subprocess.Popen``. Killed by ``close`` if still running."""
        p = subprocess.Popen(self.command(h, argv, cwd), **kwargs)
        self._procs.append(p)
        return p

    def run(self, h: int, argv: Sequence[str], *, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``h`` to completion (output captured as text)."""
        return subprocess.run(self.command(h, argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def start_ranks(self, layout: Sequence[int], argv: Sequence[str], log_dir: str, *, port: int = 29500,
                    env: dict | None = None) -> list[Rank]:
        """Start ``argv`` as the ranks of one job: ``layout[h]`` ranks in host ``h``, numbered host by host, with
        torchrun's environment (MASTER_ADDR: host 0; one thread each). Output goes to ``log_dir/rank<R>.log``.
        Each host has its own ports, so ``port`` is free on host 0 whichever runs share the machine."""
        if len(layout) != self.n or any(k < 1 for k in layout):
            raise ValueError(f"layout must give each of the {self.n} hosts at least one rank, got {list(layout)}")
        world, ranks = sum(layout), []
        for h, local_world in enumerate(layout):
            for local in range(local_world):
                rank = len(ranks)
                child_env = {**os.environ, "MASTER_ADDR": self.addr(0), "MASTER_PORT": str(port),
                             "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                             "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(h), "OMP_NUM_THREADS": "1",
                             **(env or {})}
                log = os.path.join(log_dir, f"rank{rank}.log")
                with open(log, "w") as f:
                    proc = self.popen(h, argv, env=child_env, stdout=f, stderr=subprocess.STDOUT)
                ranks.append(Rank(rank, h, proc, log))
        return ranks

    def tx_bytes(self, h: int) -> int:
        """Bytes host ``h`` has sent on its link (its veth's /sys/class/net/<dev>/statistics/tx_bytes)."""
        return self._counter(h, "tx_bytes")

    def rx_bytes(self, h: int) -> int:
        """Bytes host ``h`` has received on its link."""
        return self._counter(h, "rx_bytes")

    def _counter(self, h: int, name: str) -> int:
        # /sys shows the network namespace of whoever mounted it; `ip netns exec` mounts the host's
        out = _sh("ip", "netns", "exec", self.netns[self._check(h)], "cat",
                  f"/sys/class/net/{self.devices[h]}/statistics/{name}").stdout
        return int(out)

    def set_link(self, h: int, up: bool) -> None:
        """Take host ``h``'s link down (its cable pulled: nothing in or out) or bring it back up."""
        _sh("ip", "-n", self.netns[self._check(h)], "link", "set", self.devices[h], "up" if up else "down")

    def _check(self, h: int) -> int:
        if not isinstance(h, int) or not 0 <= h < self.n:
            raise ValueError(f"host must be an int in 0..{self.n - 1}, got {h!r}")
        return h
