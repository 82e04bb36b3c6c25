"""The order in which a multi-host URL's brokers are tried (pure: no socket, no loop)."""

from __future__ import annotations

import random

from app.amqp.dial import try_order

HOSTS = [("127.0.0.1", 5781), ("127.0.0.1", 5782), ("127.0.0.1", 5783)]


def test_the_node_just_lost_is_tried_last_whatever_the_shuffle() -> None:
    rng = random.Random(7)
    firsts = set()
    for _ in range(50):
        order = try_order(HOSTS, shuffle=rng, last=HOSTS[0])
        assert order[-1] == HOSTS[0]
        assert sorted(order) == HOSTS
        firsts.add(order[0])
    assert firsts == {HOSTS[1], HOSTS[2]}  # still spread over the others


def test_without_last_the_shuffle_alone_decides() -> None:
    assert try_order(HOSTS) == HOSTS
    orders = {tuple(try_order(HOSTS, shuffle=random.Random(seed))) for seed in range(20)}
    assert len({o[-1] for o in orders}) == 3  # any node may come last


def test_one_host_or_an_unknown_last_changes_nothing() -> None:
    assert try_order(HOSTS[:1], last=HOSTS[0]) == HOSTS[:1]
    assert try_order(HOSTS, last=("10.0.0.1", 5672)) == HOSTS
