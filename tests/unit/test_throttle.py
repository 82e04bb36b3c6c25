"""The failed-authentication throttle: per address (an IPv6 client per /64), bounded, O(1)."""

from __future__ import annotations

import time

import pytest
from fastapi import HTTPException

from app.api.limits import AuthThrottle, client_key


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fail(throttle: AuthThrottle, client: str, times: int) -> None:
    for _ in range(times):
        throttle.check(client)
        throttle.failed(client)


def test_a_client_is_refused_past_its_budget_until_the_window_passes() -> None:
    clock = Clock()
    throttle = AuthThrottle(max_failures=3, window=60.0, clock=clock)
    _fail(throttle, "198.51.100.7", 3)
    with pytest.raises(HTTPException) as refused:
        throttle.check("198.51.100.7")
    assert refused.value.status_code == 429
    throttle.check("198.51.100.8")  # another address has its own budget
    clock.now = 60.5
    throttle.check("198.51.100.7")


def test_an_ipv6_client_counts_by_its_64() -> None:
    """Issue 29, Low: one host holds a whole /64; a new address per try was never throttled."""
    throttle = AuthThrottle(max_failures=3, window=60.0, clock=Clock())
    for i in range(3):
        _fail(throttle, f"2001:db8:1:2::{i + 1:x}", 1)
    with pytest.raises(HTTPException):
        throttle.check("2001:db8:1:2:ffff::9")
    throttle.check("2001:db8:1:3::1")  # the next /64 is another client
    assert client_key("::ffff:198.51.100.7") == "::ffff:198.51.100.7"
    assert client_key("unknown") == "unknown"


def test_a_spray_of_addresses_is_bounded_and_costs_no_scan() -> None:
    """Issue 29, Low: past 10,000 addresses each failure scanned them all (1.5 ms each)."""
    throttle = AuthThrottle(max_failures=3, window=3600.0, clock=Clock(), max_clients=10_000)
    _fail(throttle, "203.0.113.1", 3)
    started = time.perf_counter()
    for i in range(30_000):
        throttle.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
    elapsed = time.perf_counter() - started
    assert len(throttle._failures) == 10_000
    assert elapsed < 3.0, f"{elapsed:.2f} s for 30,000 failures (about 30 s with a scan)"
    throttle.check("203.0.113.1")  # forgotten: it failed least recently
