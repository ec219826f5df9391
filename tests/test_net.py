"""free_port: distinct ports below the kernel's ephemeral range, never one in use."""

from __future__ import annotations

import itertools
import multiprocessing
import socket

import pytest

from llmserve import net


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except OSError:
        return 32768, 60999


def test_ports_are_distinct_free_and_outside_the_ephemeral_range():
    ports = [net.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    low, high = ephemeral_range()
    assert all(not low <= p <= high for p in ports)
    assert all(net.PORT_RANGE[0] <= p < net.PORT_RANGE[1] for p in ports)
    assert all(net.port_is_free(p) for p in ports)


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", net.free_port()))
        listener.listen()
        taken = listener.getsockname()[1]
        assert not net.port_is_free(taken)
        monkeypatch.setattr(net, "_ports", itertools.cycle([taken, taken + 1]))
        assert net.free_port() == taken + 1


def test_no_free_port_is_an_error_not_a_hang(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", net.free_port()))
        listener.listen()
        taken = listener.getsockname()[1]
        monkeypatch.setattr(net, "_ports", itertools.repeat(taken))
        with pytest.raises(OSError, match="no free TCP port"):
            net.free_port()


def _child_ports(queue) -> None:
    queue.put([net.free_port() for _ in range(20)])


def test_a_forked_child_does_not_repeat_its_parents_next_ports():
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_ports, args=(queue,))
    child.start()
    theirs = queue.get(timeout=30)
    child.join(timeout=30)
    ours = [net.free_port() for _ in range(20)]
    assert ours != theirs  # the same sequence, without the at-fork restart
