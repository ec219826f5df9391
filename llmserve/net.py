"""Local networking helpers."""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading

# Ports are handed out below Linux's ephemeral range (32768-60999 by default), from which
# the kernel draws the source port of every outgoing connection and every bind to port 0.
# A port from bind(0) is free only until the socket closes: a client connecting anywhere
# (or a later bind(0)) may take it before the caller's server binds it, which is how a
# test platform's server once failed with "address already in use". Below that range no
# connection lands by chance, and one process never hands the same port out twice
# within a pass, so servers started together cannot take each other's ports.
PORT_RANGE = (20000, 32000)


def _port_sequence(low: int, high: int) -> itertools.cycle:
    """Every port of [low, high) once per cycle, from a start that differs by process."""
    span = high - low
    start = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little")).randrange(span)
    return itertools.cycle([low + (start + i) % span for i in range(span)])


_ports = _port_sequence(*PORT_RANGE)
_ports_lock = threading.Lock()


def _restart_after_fork() -> None:
    """A forked child starts its own sequence: it would otherwise hand out its parent's next ports."""
    global _ports, _ports_lock
    _ports, _ports_lock = _port_sequence(*PORT_RANGE), threading.Lock()


os.register_at_fork(after_in_child=_restart_after_fork)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `port` on `host` now."""
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
