"""Local networking helpers."""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading

# Ports are handed out below the kernel's ephemeral range (Linux: 32768-60999 by default),
# from which it draws the source port of every outgoing connection and every bind to port 0.
# A port from bind(0) is free only until the socket closes: a client connecting anywhere
# (or a later bind(0)) may take it before the caller's server binds it, which is how a
# test platform's server once failed with "address already in use". Below that range no
# connection lands by chance, and one process hands its ports out in turn, never the same
# one twice within a pass, so servers started together cannot take each other's ports.
# (Two processes walk from different random starts: they meet only if they reach the same
# port within the moments before its server binds it.)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def port_range(ephemeral_file: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """[low, high): up to 12,000 ports just below the ephemeral range, ending at 32,000 at most
    (20000-32000 with Linux's default); every unprivileged port when the ephemeral range
    leaves fewer than 1,000 below it."""
    try:
        with open(ephemeral_file) as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    high = min(32000, ephemeral_low)
    low = max(1024, high - 12000)
    return (low, high) if high - low >= 1000 else (1024, 65536)


PORT_RANGE = port_range()


def _port_sequence(low: int, high: int) -> itertools.cycle:
    """Every port of [low, high) once per cycle, from a start that differs by process."""
    span = high - low
    start = random.SystemRandom().randrange(span)
    return itertools.cycle([low + (start + i) % span for i in range(span)])


_ports = _port_sequence(*PORT_RANGE)
_ports_lock = threading.Lock()


def _restart_after_fork() -> None:
    """A forked child starts its own sequence: it would otherwise hand out its parent's next ports."""
    global _ports, _ports_lock
    _ports, _ports_lock = _port_sequence(*PORT_RANGE), threading.Lock()


os.register_at_fork(after_in_child=_restart_after_fork)


def port_is_free(port: int, hosts: tuple[str, ...] = ("127.0.0.1", "")) -> bool:
    """Whether a server could bind `port` on each of `hosts` now ("": every IPv4 address, as
    the tensor-parallel workers' store binds)."""
    for host in hosts:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now and that this process
    has not handed out recently (see PORT_RANGE)."""
    with _ports_lock:
        for _ in range(PORT_RANGE[1] - PORT_RANGE[0]):
            port = next(_ports)
            if port_is_free(port):
                return port
    raise OSError(f"no free TCP port in {PORT_RANGE[0]}-{PORT_RANGE[1] - 1} on 127.0.0.1")
