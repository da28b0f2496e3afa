"""The job's authenticated store: the same answers as torch's HashStore for the job's processes, nothing for anyone
else (wrong secret, no handshake, a TCPStore client), no trust in a server that cannot prove the secret, the secret
file's permissions checked, and the secret handed to the workers privately (environment, never a command line).
The acceptance test at the end is the attack itself, by another local user."""
import json
import os
import pathlib
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import fanfold
from fanfold._core.job import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    AuthenticationError,
    JobStore,
    StoreServer,
    job_secret,
)

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
T = timedelta(seconds=10)


@pytest.fixture
def server():
    s = StoreServer(b"the job's secret")
    yield s
    s.close()


def _same_ops(store):
    out = []
    store.set("a", b"1")
    store.set("s", "text")
    out += [store.get("a"), store.get("s"), store.add("n", 5), store.add("n", -2), store.get("n")]
    out += [store.compare_set("c", "", "x"), store.compare_set("c", "y", "z"), store.compare_set("c", "x", "z"),
            store.compare_set("missing", "e", "d"), store.check(["a", "c"]), store.check(["a", "nope"])]
    store.append("ap", b"12")
    store.append("ap", b"34")
    store.multi_set(["m1", "m2"], [b"u", b"v"])
    out += [store.get("ap"), store.multi_get(["m2", "m1"]), store.delete_key("a"), store.delete_key("a"),
            store.check(["a"]), store.num_keys()]
    store.wait(["m1"], timedelta(seconds=1))
    return out


def test_answers_as_torch_hash_store(server):
    client = JobStore("127.0.0.1", server.port, b"the job's secret", T)
    assert _same_ops(client) == _same_ops(dist.HashStore())
    prefixed = dist.PrefixStore("job", client)  # as torch and fanfold use it
    prefixed.set("k", b"v")
    assert client.get("job/k") == b"v" and prefixed.add("i", 2) == 2
    with pytest.raises(dist.DistStoreError, match=r"timed out: keys \['never'\] not set within 0.2 s"):
        client.wait(["never"], timedelta(seconds=0.2))
    client.set_timeout(timedelta(seconds=0.3))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="not set within 0.3 s"):
        client.get("never")  # a get waits for its key, at most the store's timeout
    assert time.monotonic() - t0 < 5


def test_a_get_waits_for_a_set_from_another_client(server):
    a = JobStore("127.0.0.1", server.port, b"the job's secret", T)
    b = JobStore("127.0.0.1", server.port, b"the job's secret", T)
    threading.Timer(0.2, lambda: b.set("late", b"here")).start()
    assert a.get("late") == b"here"


def test_strangers_are_refused(server):
    JobStore("127.0.0.1", server.port, b"the job's secret", T).set("key", b"value")
    with pytest.raises(AuthenticationError, match="refused this process: its secret is not this job's"):
        JobStore("127.0.0.1", server.port, b"a guess", T)
    # a client skipping the handshake: its request is read as a (wrong) proof, and the connection closed unanswered
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.recv(64)
        s.sendall(b"\x00\x00\x00\x02\x00\x00\x00\x03get\x00\x00\x00\x03key" + b"\x00" * 64)
        s.settimeout(5)
        try:
            answer = s.recv(4096)
        except ConnectionResetError:  # closed with our bytes unread: a reset instead of an end of file
            answer = b""
        assert answer == b""
    with pytest.raises(Exception, match="Ping failed|invalid value|not set|timed out|closed|reset"):
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2)).get("key")


def test_the_client_refuses_a_server_that_cannot_prove_the_secret():
    listener = socket.create_server(("127.0.0.1", 0))
    seen = []

    def impostor():  # greets like the real server and accepts any proof
        conn, _ = listener.accept()
        conn.sendall(b"fanfold-store/2\n" + secrets.token_bytes(32))
        seen.append(conn.recv(64))
        conn.sendall(secrets.token_bytes(32))
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(AuthenticationError, match="could not prove the job's secret"):
        JobStore("127.0.0.1", listener.getsockname()[1], b"the job's secret", T)
    assert seen and b"the job's secret" not in seen[0]  # what crossed the wire: a nonce and an HMAC, not the secret
    listener.close()


_FREED_WHILE_CALLED = """
import sys, threading, time
import torch.distributed as dist
from fanfold._core.job import JobStore, StoreServer
server = StoreServer(b"s" * 32)
errors = set()
for _ in range(150):
    store = JobStore(server.host, server.port, b"s" * 32)
    # what the stall inspector's writer holds: the C++ half of a clone, whose Python half its parent keeps
    twin = dist.PrefixStore("p/", store).clone()
    stop = threading.Event()
    def write():
        while not stop.is_set():
            try:
                twin.set("k", "v")
            except Exception as exc:
                errors.add(type(exc).__name__)
    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.01)
    del store  # the group is destroyed: the store and its clone are freed while the writer calls the clone
    time.sleep(0.005)
    stop.set()
    writer.join()
print("errors", sorted(errors))
"""


def test_a_store_freed_while_another_thread_calls_it_gives_that_call_an_error_not_a_crash():
    # destroy_process_group frees the job's store while the stall inspector's writer thread may be in a call on its
    # clone. That once ended a worker with SIGSEGV (the call landed in a half-freed object) in 5 runs of 5 of this
    # program; now the late calls raise.
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run([sys.executable, "-c", _FREED_WHILE_CALLED], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DistStoreError" in done.stdout  # the calls after the free were answered with the store's own error


def test_secret_from_env_or_a_private_file(tmp_path, monkeypatch):
    def secret_with(**env):
        monkeypatch.delenv(SECRET_ENV, raising=False)
        monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return job_secret()

    in_file, in_env = secrets.token_hex(16), secrets.token_hex(16)
    path = tmp_path / "secret"
    path.write_text(f"  {in_file}\n")
    path.chmod(0o600)
    assert secret_with(FANFOLD_JOB_SECRET_FILE=str(path)) == in_file.encode()
    assert secret_with(FANFOLD_JOB_SECRET=in_env, FANFOLD_JOB_SECRET_FILE=str(path)) == in_env.encode()
    assert secret_with() is None
    path.chmod(0o640)
    with pytest.raises(PermissionError, match=r"has mode 0640: other users may read or write it; .*chmod 600"):
        secret_with(FANFOLD_JOB_SECRET_FILE=str(path))
    path.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(PermissionError, match="symbolic link is refused"):
        secret_with(FANFOLD_JOB_SECRET_FILE=str(link))
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        with pytest.raises(PermissionError, match="belongs to uid 65534, not to this job's user"):
            secret_with(FANFOLD_JOB_SECRET_FILE=str(path))


def _innermost(store):
    while hasattr(store, "underlying_store"):  # torch's PrefixStores around the rendezvous store
        store = store.underlying_store
    return type(store).__name__


def _secret_seen_by_worker():
    import torch.distributed as dist

    dist.init_process_group("gloo")  # torch's own env:// rendezvous: routed to the launch's store
    store = dist.distributed_c10d._get_default_store()
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
    secret = os.environ[SECRET_ENV]
    return secret, secret.encode() in cmdline, _innermost(store)


def test_launch_hands_the_secret_through_the_environment_only():
    out = fanfold.launch(_secret_seen_by_worker, nprocs=2, timeout=60)
    assert out[0][0] == out[1][0] and len(out[0][0]) == 64  # one fresh 256-bit secret per launch, in hex
    assert not out[0][1] and not out[1][1]  # never on the command line (ps shows that to every user)
    assert out[0][2] == "JobStore"
    assert fanfold.launch(_secret_seen_by_worker, nprocs=2, timeout=60)[0][0] != out[0][0]


# --- the acceptance test: another local user attacks a running job -----------------------------------------------

_ATTACKER = r"""
import json, os, sys
from datetime import timedelta
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from fanfold._core.job import JobStore
port, key, target, pids = int(sys.argv[2]), sys.argv[3], sys.argv[4], [int(p) for p in sys.argv[5].split(",")]
out = {"uid": os.geteuid()}
def attempt(name, fn):
    try:
        out[name] = ["ok", fn()]
    except Exception as exc:
        out[name] = ["refused", f"{type(exc).__name__}: {exc}"[:300]]
def tcp():
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3))
attempt("read", lambda: tcp().get(key).decode())
attempt("write", lambda: tcp().set(key, target) or "written")
attempt("guess", lambda: JobStore("127.0.0.1", port, b"a guessed secret", timedelta(seconds=3)).get(key).decode())
def environ():
    found = []
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            found.append(b"FANFOLD_JOB_SECRET" in f.read())
    return found
attempt("environ", environ)
print(json.dumps(out))
"""


def _attack(port, key, target, pids, tmp_path):
    script = tmp_path / "attacker.py"
    script.write_text(_ATTACKER)
    script.chmod(0o644)
    cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-B", str(script), SRC,
           str(port), key, target, ",".join(map(str, pids))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _job_under_attack(tmp, canary):
    """Rank 0 of a fanfold.launch job lets `nobody` attack the job's store, then both ranks build the shm
    transport (its segment's name crosses that store) and all-reduce through it."""
    import torch
    import torch.distributed as dist

    from fanfold.collectives.shm.transport import ShmTransport

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    result = None
    if rank == 0:
        key = "fanfold/shm/0/1/name"
        dist.distributed_c10d._get_default_store().set(key, "fanfold-1-2-0123456789ab")
        result = _attack(int(os.environ["MASTER_PORT"]), key, os.path.relpath(canary, "/dev/shm"), pids,
                         pathlib.Path(tmp))
    dist.barrier()
    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    with ShmTransport(timeout=30) as t:
        t.all_reduce(x).wait()
    dist.destroy_process_group()
    return result, x.tolist()


@pytest.fixture
def root_dir():
    """A directory of root's that `nobody` may enter and read, not write (pytest's own tmp_path is 0700)."""
    path = tempfile.mkdtemp(prefix="fanfold-attack-")
    os.chmod(path, 0o755)
    yield pathlib.Path(path)
    shutil.rmtree(path)


def test_another_user_can_neither_read_nor_write_the_jobs_store(root_dir):
    if os.geteuid() != 0:
        pytest.skip("the attack runs as user `nobody` through setpriv, which needs root; this run is not root")
    assert shutil.which("setpriv"), "running as root but setpriv (util-linux) is missing: the attack cannot run"
    pwd.getpwnam("nobody")
    probe = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-B",
                            "-c", f"import sys; sys.path.insert(0, {SRC!r}); import torch, fanfold"],
                           capture_output=True, text=True, timeout=120, cwd="/")
    if probe.returncode != 0 and "Permission" in probe.stderr:
        pytest.skip("user `nobody` cannot import torch and fanfold from this checkout (a directory above it is not "
                    f"readable by others), so the attacker cannot run: {probe.stderr.strip().splitlines()[-1]}")
    tmp_path = root_dir
    canary = tmp_path / "canary"
    canary.write_bytes(b"root's file" * 1000)
    canary.chmod(0o600)
    key = "fanfold/shm/0/1/name"

    # Positive control: the same attacker against a bare TCPStore (what a job's store was) reads and rewrites it.
    bare = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    bare.set(key, "fanfold-1-2-0123456789ab")
    control = _attack(bare.port, key, os.path.relpath(canary, "/dev/shm"), [os.getpid()], tmp_path)
    assert control["uid"] == 65534
    assert control["read"] == ["ok", "fanfold-1-2-0123456789ab"], control
    assert control["write"] == ["ok", "written"], control
    assert bare.get(key).decode() == os.path.relpath(canary, "/dev/shm")  # the redirect is in place
    # ... and a rank that reads that name refuses it, naming the key, before opening anything
    from fanfold.collectives.shm.segment import Segment

    prefix = key.rpartition("/")[0]
    bare.set(f"{prefix}/attached/0", "ok")  # rank 0's side, as a PrefixStore over the same store writes it
    with pytest.raises(RuntimeError, match="store's key 'name' holds '../"):
        Segment(dist.PrefixStore(prefix, bare), 1, 2, 4096, timeout=5.0, check_pids=False)
    del bare

    (result, summed), (_, summed1) = fanfold.launch(_job_under_attack, str(tmp_path), str(canary), nprocs=2,
                                                    timeout=180)
    assert result["uid"] == 65534
    for what in ("read", "write", "guess"):
        assert result[what][0] == "refused", (what, result)
    assert "refused this process" in result["guess"][1]
    assert result["environ"][0] == "refused" and "Permission" in result["environ"][1]  # the secret stays private
    assert summed == summed1 == [3.0 * i for i in range(6)]  # the job itself ran, through the segment
    assert canary.read_bytes() == b"root's file" * 1000 and os.stat(canary).st_uid == 0
    assert sorted(os.listdir(tmp_path)) == ["attacker.py", "canary"]


_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
if sys.argv[2] == "fanfold":
    import fanfold.distributed as fd
    fd.init_process_group("gloo", timeout=60)
else:
    dist.init_process_group("gloo")  # a plain torch script
x = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(x)
inner = dist.distributed_c10d._get_default_store()
while hasattr(inner, "underlying_store"):
    inner = inner.underlying_store
with open("/proc/self/cmdline", "rb") as f:
    on_cmdline = os.environ.get("FANFOLD_JOB_SECRET", "\0").encode() in f.read()
print(json.dumps({"rank": dist.get_rank(), "sum": x.tolist(), "store": type(inner).__name__,
                  "on_cmdline": on_cmdline}), flush=True)
dist.destroy_process_group()
"""


def _reports(cmd, tmp_path, env):
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    how = env.pop("_HOW")
    done = subprocess.run([*cmd, str(script), SRC, how], env=env,
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    # torchrun passes the workers' output through unbuffered: two reports may share a line
    lines = [json.loads(m) for m in re.findall(r'\{[^{}]*"rank"[^{}]*\}', done.stdout)]
    return sorted(lines, key=lambda r: r["rank"])


@pytest.mark.parametrize("how", ["plain", "fanfold"])
def test_fanfold_run_workers_join_the_authenticated_store(tmp_path, how):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FANFOLD_JOB_")}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1", _HOW=how)
    out = _reports([sys.executable, "-m", "fanfold", "run", "-n", "2"], tmp_path, env)
    assert [r["sum"] for r in out] == [[3.0, 3.0]] * 2
    assert {r["store"] for r in out} == {"JobStore"} and not any(r["on_cmdline"] for r in out)


def test_torchrun_with_the_users_secret_file_gets_an_authenticated_store(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FANFOLD_JOB_")}
    env.update({SECRET_FILE_ENV: str(secret), "OMP_NUM_THREADS": "1", "_HOW": "fanfold"})
    out = _reports([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
                   tmp_path, env)
    assert [r["sum"] for r in out] == [[3.0, 3.0]] * 2
    assert {r["store"] for r in out} == {"JobStore"}  # rank 0 serves it; torchrun's store holds only its address


_OWN_CLIENT = """
import json, os, sys, time
from datetime import timedelta
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist

addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
start = time.monotonic()
try:
    dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=60))
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
took = time.monotonic() - start
rank = int(os.environ["RANK"])
store, _, world = next(dist.rendezvous("env://"))  # the first way the message names; the iterator is dropped
store.set(f"own/{rank}", str(rank * 10))
seen = [store.get(f"own/{r}").decode() for r in range(world)]
dist.init_process_group("gloo")
default = dist.distributed_c10d._get_default_store()  # the second way
default.set(f"pg/{rank}", str(rank * 100))
seen_pg = [default.get(f"pg/{r}").decode() for r in range(world)]
print(json.dumps({"rank": rank, "error": error, "took": took, "seen": seen, "seen_pg": seen_pg}), flush=True)
dist.destroy_process_group()
"""


def test_a_torch_tcpstore_client_of_the_job_store_fails_at_once_saying_how_to_get_a_store(tmp_path):
    # torch's client takes the store's greeting for a failed ping and retries until its timeout (60 s here); under
    # `fanfold run` it raises at once, naming the port and two ways to a shared store, both of which are shown working
    script = tmp_path / "own_client.py"
    script.write_text(_OWN_CLIENT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FANFOLD_JOB_")}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "fanfold", "run", "-n", "2", str(script), SRC], env=env,
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    out = sorted((json.loads(m) for m in re.findall(r'\{[^{}]*"rank"[^{}]*\}', done.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in out] == [0, 1]
    for r in out:
        assert r["error"] and r["error"].startswith("DistStoreError: MASTER_ADDR:MASTER_PORT"), r["error"]
        assert "fanfold's job store" in r["error"] and 'rendezvous("env://")' in r["error"]
        assert "_get_default_store()" in r["error"]
        assert r["took"] < 30, r  # torch's own client would wait out its 60 s
        assert r["seen"] == ["0", "10"] and r["seen_pg"] == ["0", "100"]
