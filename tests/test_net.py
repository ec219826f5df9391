"""free_port: distinct ports below the kernel's ephemeral range, never one in use."""

from __future__ import annotations

import itertools
import multiprocessing
import socket

import pytest

from llmserve import net

pytestmark = pytest.mark.integration


def ephemeral_range() -> tuple[int, int]:
    try:
        with open(net.EPHEMERAL_RANGE_FILE) as f:
            low, high = f.read().split()
        return int(low), int(high)
    except OSError:
        return 32768, 60999


def test_ports_are_distinct_and_outside_the_ephemeral_range():
    ports = [net.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    low, high = ephemeral_range()
    if net.PORT_RANGE != (1024, 65536):  # (a host whose ephemeral range leaves no room below it)
        assert all(not low <= p <= high for p in ports)
    assert all(net.PORT_RANGE[0] <= p < net.PORT_RANGE[1] for p in ports)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("32768\t60999\n", (20000, 32000)), ("20000 60999", (8000, 20000)), ("1500 65535", (1024, 65536)),
     ("", (20000, 32000)), (None, (20000, 32000))],
)  # fmt: skip
def test_the_range_sits_below_the_ephemeral_one(tmp_path, text, expected):
    path = tmp_path / "ip_local_port_range"
    if text is not None:
        path.write_text(text)
    assert net.port_range(str(path)) == expected


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", net.free_port()))
        listener.listen()
        taken, free = listener.getsockname()[1], net.free_port()
        assert not net.port_is_free(taken) and net.port_is_free(free)
        monkeypatch.setattr(net, "_ports", itertools.cycle([taken, free]))
        assert net.free_port() == free


def test_a_port_bound_on_every_address_is_not_free():
    with socket.socket() as listener:
        listener.bind(("", net.free_port()))  # as the tensor-parallel workers' store binds
        listener.listen()
        assert not net.port_is_free(listener.getsockname()[1])


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
