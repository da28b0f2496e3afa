"""Segment names in /dev/shm: only fanfold's own pattern is used, creating never follows or reuses an entry,
opening never follows a link, and a rank unlinks only the file it created or opened. Every attack leaves the file it
aims at (outside /dev/shm) as it was."""
import os
import secrets
import stat

import pytest

from fanfold._core.shm import SHM_DIR, FileId, check_name, create_segment, open_segment, pid_namespace, unlink, unmap
from fanfold.collectives.shm.segment import SEGMENT_NAME, Segment, _from_store, segment_name

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this machine")


def _name():
    return f"fanfold-test-{os.getpid()}-{secrets.token_hex(4)}"


@pytest.fixture
def shm_name():
    name = _name()
    yield name
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "canary"
    path.write_bytes(b"keep me" * 100)
    return path


def test_names_made_match_the_pattern():
    for pidns in (pid_namespace(), "", "4026531836"):
        name = segment_name(pidns)
        assert SEGMENT_NAME.fullmatch(name), name
        assert check_name(name) == name


@pytest.mark.parametrize("bad", ["../../etc/passwd", "a/b", "/dev/shm/x", "..", ".", ".hidden", "", "a..b",
                                 "x\0y", "x\ny", "é", "a" * 201, None, b"fanfold-1-2-abcdefabcdef"])
def test_unsafe_names_are_refused(bad):
    with pytest.raises(ValueError, match="not a plain /dev/shm file name"):
        check_name(bad)


@pytest.mark.parametrize("value", [b"../../tmp/victim", b"fanfold-1-2-abcdefabcdef/..", b"fanfold-1-2-ABCDEFABCDEF",
                                   b"fanfold-1-2-abcdefabcde", b"fanfold-1-2-abcdefabcdef0", b"fanfold--2-abcdefabcdef",
                                   b"/dev/shm/fanfold-1-2-abcdefabcdef", b"other-1-2-abcdefabcdef"])
def test_a_name_read_from_the_store_must_match_the_pattern(value):
    with pytest.raises(ValueError, match="store's key 'fanfold/shm/0/name' holds .* not a fanfold segment name"):
        _from_store(value, "fanfold/shm/0/name")
    assert _from_store(b"fanfold-4026531836-41-0123456789ab", "k") == "fanfold-4026531836-41-0123456789ab"
    assert _from_store(b"", "k") is None  # rank 0's "I could not create it"


def test_create_is_exclusive_mode_0600_and_unlinks_its_own(shm_name):
    os.umask(old := os.umask(0))  # the widest umask: the mode must not depend on it
    try:
        mm, ident = create_segment(shm_name, 8192)
    finally:
        os.umask(old)
    path = os.path.join(SHM_DIR, shm_name)
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid() and st.st_size == 8192
    assert ident == FileId(st.st_dev, st.st_ino)
    with pytest.raises(FileExistsError):
        create_segment(shm_name, 8192)
    mm2, ident2 = open_segment(shm_name, 8192)
    assert ident2 == ident
    assert unlink(shm_name, ident) is True and not os.path.lexists(path)
    assert unlink(shm_name, ident) is False  # already gone: nothing to do
    unmap(mm)
    unmap(mm2)


@pytest.mark.parametrize("target_exists", [True, False])
def test_create_refuses_a_planted_symlink(shm_name, canary, target_exists):
    target = canary if target_exists else canary.with_name("not-yet")
    os.symlink(target, os.path.join(SHM_DIR, shm_name))
    with pytest.raises(FileExistsError):
        create_segment(shm_name, 4096)
    if target_exists:
        assert canary.read_bytes() == b"keep me" * 100
    else:
        assert not target.exists()  # O_CREAT through a dangling link would have made it


def test_open_refuses_a_symlink_and_another_users_file(shm_name, canary):
    os.symlink(canary, os.path.join(SHM_DIR, shm_name))
    with pytest.raises(OSError):  # ELOOP: O_NOFOLLOW
        open_segment(shm_name, canary.stat().st_size)
    assert canary.read_bytes() == b"keep me" * 100
    os.unlink(os.path.join(SHM_DIR, shm_name))
    with open(os.path.join(SHM_DIR, shm_name), "wb") as f:
        f.write(b"\0" * 4096)
    if os.geteuid() == 0:
        os.chown(os.path.join(SHM_DIR, shm_name), 65534, 65534)
        with pytest.raises(RuntimeError, match="belongs to uid 65534"):
            open_segment(shm_name, 4096)


def test_unlink_leaves_another_file_under_the_same_name(shm_name):
    mm, ident = create_segment(shm_name, 4096)
    path = os.path.join(SHM_DIR, shm_name)
    os.unlink(path)
    with open(path, "wb") as f:  # the name now points at another inode: someone else's file
        f.write(b"theirs")
    assert unlink(shm_name, ident) is False
    with open(path, "rb") as f:
        assert f.read() == b"theirs"
    os.unlink(path)
    os.symlink("/etc/hostname", path)  # a link under the name is never what this rank created either
    assert unlink(shm_name, ident) is False and os.path.islink(path)
    unmap(mm)


class _DictStore:
    """The few store methods Segment uses, over a dict: rank 0's side already done (name published, attached)."""

    def __init__(self, values):
        self.values = dict(values)

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)

    def wait(self, keys, timeout=None):
        assert self.check(keys)


def test_a_rewritten_name_is_refused_and_nothing_outside_dev_shm_is_touched(canary):
    rel = os.path.relpath(canary, SHM_DIR)  # ../../tmp/.../canary
    store = _DictStore({"name": rel.encode(), "attached/0": b"ok"})
    with pytest.raises(RuntimeError, match=r"could not be mapped on ranks \[1\].*store's key 'name' holds .* refused"):
        Segment(store, 1, 2, 4096, timeout=2.0, check_pids=False)
    assert canary.read_bytes() == b"keep me" * 100
    assert store.values["attached/1"].startswith(b"ValueError")  # rank 0 hears why too


def test_a_pattern_name_that_is_a_link_out_of_dev_shm_is_refused(canary):
    name = segment_name(pid_namespace())
    path = os.path.join(SHM_DIR, name)
    os.symlink(canary, path)
    try:
        store = _DictStore({"name": name.encode(), "attached/0": b"ok"})
        with pytest.raises(RuntimeError, match=r"could not be mapped on ranks \[1\]"):
            Segment(store, 1, 2, 4096, timeout=2.0, check_pids=False)
        assert canary.read_bytes() == b"keep me" * 100
        assert os.path.islink(path)  # not this rank's file: not unlinked either
    finally:
        os.unlink(path)
