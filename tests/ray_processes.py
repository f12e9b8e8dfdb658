"""The processes of a Ray cluster a test started, found and stopped by PID (never ``ray stop``, which
stops every Ray process on the host), and the sockets they listen on (importable by name, like ports)."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import time
from pathlib import Path

import psutil


def processes_of(pgid: int, marker: str) -> list[int]:
    """PIDs in our process group, or whose command line names our cluster's temp dir, and their descendants
    (nothing else)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            mine = os.getpgid(int(entry.name)) == pgid
            mine = mine or marker in (entry / "cmdline").read_bytes().decode(errors="replace")
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        if mine:
            pids.append(int(entry.name))
    for pid in list(pids):  # Ray's workers (actors, the Serve proxy) run in sessions of their own, below the raylet
        try:
            pids += [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return sorted(set(pids) - {os.getpid()})


def stop_only(pgid: int, marker: str) -> list[int]:
    """Stop the processes of ``processes_of`` (TERM, then KILL); the PIDs still running after that."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        for pid in processes_of(pgid, marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while processes_of(pgid, marker) and time.monotonic() < deadline:
            time.sleep(0.5)
    return processes_of(pgid, marker)


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped loopback (``::ffff:127.0.0.1``, a dual-stack socket bound to 127.0.0.1)."""
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def bound_sockets(pids: list[int]) -> list[tuple[str, int, str, int]]:
    """(ip, port, process name, pid) of every listening TCP socket and every bound UDP socket of ``pids``."""
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            name = process.name()
            for conn in process.net_connections(kind="inet"):
                listening = conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM and not conn.raddr)
                if listening and conn.laddr:
                    found.append((conn.laddr.ip, conn.laddr.port, name, pid))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found
