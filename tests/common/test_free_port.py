"""free_port chooses outside the ephemeral range, where client sockets cannot take it."""

from __future__ import annotations

import random
import socket

from common import redis_server
from common.redis_server import _ephemeral_range, free_port, reserve_ports


def test_free_ports_lie_outside_the_ephemeral_range_and_can_be_bound():
    low, high = _ephemeral_range()
    for _ in range(50):
        port = free_port()
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_seeding_the_global_random_does_not_fix_the_choice():
    state = random.getstate()   # given back after: other tests share this process's random
    try:
        random.seed(7)
        first = [free_port() for _ in range(5)]
        random.seed(7)
        assert [free_port() for _ in range(5)] != first
    finally:
        random.setstate(state)


def test_a_run_of_ports_lies_wholly_outside_the_ephemeral_range_and_is_free():
    low, high = _ephemeral_range()
    for _ in range(50):
        base = free_port(count=8)
        for port in range(base, base + 8):
            assert not low <= port <= high
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_a_chosen_port_is_not_chosen_again_while_reserved_even_if_still_unbound():
    """Two callers (two test workers) that choose before either server binds must
    not meet: the chosen port stays reserved, bound or not."""
    base = free_port(count=4)
    assert not reserve_ports(base + 2)   # still unbound, but reserved
    chosen = {free_port() for _ in range(300)}
    assert chosen.isdisjoint(range(base, base + 4))


def test_a_reservation_lapses_after_its_time(monkeypatch):
    port = free_port()
    assert not reserve_ports(port)
    monkeypatch.setattr(redis_server, "RESERVATION_S", 0.0)
    assert reserve_ports(port)
