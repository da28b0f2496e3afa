"""Test helper: the TCP sockets a process listens on, read from /proc (Linux)."""
import os


def listening_addresses(pid: int) -> list[str]:
    """Local addresses (hex, /proc/net byte order: 127.0.0.1 is 0100007F) of the TCP sockets in LISTEN state that
    process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    found.append(cols[1].split(":")[0])
    return found
