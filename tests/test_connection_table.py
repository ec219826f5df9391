"""The bookkeeping under the connection caps (llmserve/http_connection_table.py): which connection
is let go for a new one, and when a new one is refused. The servers' behaviour is tested on real
servers in test_connection_limits.py."""

from __future__ import annotations

import resource

import pytest

from llmserve.http_connection_table import ConnectionTable, connection_cap

pytestmark = pytest.mark.unit


def test_over_the_total_the_longest_waiting_is_shed_and_busy_ones_never_are():
    table = ConnectionTable(3)
    for conn in "abc":
        assert table.admit(conn, "10.0.0." + conn).shed == []
    table.busy("a")  # a whole request: the server works on it
    table.waiting("b")  # b's request done, it waits again: now the newest
    admitted = table.admit("d", "10.0.0.9")
    assert admitted.shed == ["c"] and admitted.refused is None and len(table) == 3
    table.busy("b")
    table.busy("d")
    assert table.admit("e", "10.0.0.9").refused == 503 and len(table) == 3  # all busy: the new one is refused
    table.remove("a")
    assert table.admit("e", "10.0.0.9").refused is None


def test_over_a_clients_cap_that_clients_longest_waiting_is_shed_then_it_is_refused():
    table = ConnectionTable(100, max_per_client=2)
    table.admit("x1", "attacker")
    table.admit("other", "someone")
    table.admit("x2", "attacker")
    assert table.admit("x3", "attacker").shed == ["x1"]  # its own, not someone else's
    table.busy("x2")
    table.busy("x3")
    assert table.admit("x4", "attacker").refused == 429
    assert table.admit("y", "someone").refused is None
    assert table.clients() == {"attacker": 2, "someone": 2}
    table.remove("x2")
    table.remove("x2")  # twice: no harm
    assert table.clients() == {"attacker": 1, "someone": 2}


def test_settings_are_checked():
    with pytest.raises(ValueError):
        ConnectionTable(0)
    with pytest.raises(ValueError):
        ConnectionTable(10, -1)


def test_the_cap_stays_under_half_the_open_file_limit_raised_to_its_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        limit = hard if hard != resource.RLIM_INFINITY else None
        cap = connection_cap(10**9)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard  # raised
        if limit is not None:
            assert cap == limit // 2
        assert connection_cap(5) == 5
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
