"""New rows reach the publisher without waiting for a poll: PostgreSQL LISTEN/NOTIFY, with
polling as the fallback when the notification never comes."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
from sqlalchemy import Engine, make_url, text

from app.db import make_engine
from app.publisher import listener
from chaos.proxy import TcpProxy
from tests.support.factories import add_rows
from tests.support.publisher import all_in, rows, running_publisher, settings_for, wait_rows

SLOW_POLL = 5.0  # a poll this slow cannot explain a claim within a second


async def _time_to_confirm(engine: Engine, settings: object, exchange: str) -> float:
    async with running_publisher(settings, engine) as publisher:  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while not publisher.listener.listening and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(SLOW_POLL + 0.5)  # the startup claims are over: the claimer idles
        began = time.monotonic()
        add_rows(engine, n=5, exchange=exchange)
        await wait_rows(engine, all_in("confirmed"), timeout=30)
        return time.monotonic() - began


async def test_a_committed_row_is_claimed_at_once_not_at_the_next_poll(
    pg_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    engine = make_engine(pg_url)
    try:
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, poll_interval=SLOW_POLL)
        took = await _time_to_confirm(engine, settings, topology["exchange"])
        assert took < 1.0, f"{took:.2f}s: the notification did not wake the claimer"
    finally:
        engine.dispose()


async def test_without_notifications_the_poll_still_finds_the_rows(
    pg_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    """The trigger gone (or the notification lost): rows are still claimed, at the next poll."""
    engine = make_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER outbox_notify_new ON outbox"))
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, poll_interval=SLOW_POLL)
        took = await _time_to_confirm(engine, settings, topology["exchange"])
        assert 1.0 < took < SLOW_POLL + 3, f"{took:.2f}s"
        assert len(rows(engine)) == 5
    finally:
        engine.dispose()


async def test_a_database_outage_costs_the_listener_two_lines_not_one_per_attempt(
    pg_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL refusing connections (a TCP proxy that stops listening): the listener retries
    every 0.05 s, logs a WARNING at the first failure and an INFO with the outage's length when
    it listens again, the attempts in between at DEBUG."""
    monkeypatch.setattr(listener, "RETRY_MIN", 0.05)
    monkeypatch.setattr(listener, "RETRY_MAX", 0.05)
    caplog.set_level(logging.INFO, logger="app.publisher.listener")
    url = make_url(pg_url)
    proxy = TcpProxy(upstream_host=url.host or "127.0.0.1", upstream_port=url.port or 5432)
    await proxy.start()
    via = url.set(port=proxy.port).render_as_string(hide_password=False)
    wakes: list[float] = []
    ear = listener.Listener(url=via, wake=lambda: wakes.append(time.monotonic()))
    task = asyncio.create_task(ear.run())
    try:
        async with asyncio.timeout(20):
            while not ear.listening:
                await asyncio.sleep(0.02)
            await proxy.refuse()
            while ear.listening or ear._failures < 20:
                await asyncio.sleep(0.02)
            await proxy.accept()
            while not ear.listening:
                await asyncio.sleep(0.02)
    finally:
        ear.stop()
        await task
        await proxy.close()
    lines = [r.getMessage() for r in caplog.records]
    failed = [line for line in lines if "polling meanwhile" in line]
    again = [line for line in lines if "again after" in line]
    assert len(failed) == 1 and failed[0].startswith("LISTEN outbox_new on"), lines
    assert len(again) == 1 and re.search(r"\(\d{2,} attempts failed\)", again[0]), again
    assert len(wakes) == 2  # listening at start and again: rows committed meanwhile are claimed


async def test_the_listener_follows_a_multi_host_url_to_the_host_that_answers(
    pg_url: str,
) -> None:
    """Issue 49: the engine follows ``?host=a&host=b&target_session_attrs=read-write`` (libpq
    tries each host for the primary), but the listener rendered it back as a URL that libpq read
    as one host named ``127.0.0.1:<port>``: it never listened, and a WARNING came every minute.
    Here the first host refuses (a port nothing listens on) and the second is the database: the
    listener listens there and a committed row wakes it."""
    url = make_url(pg_url)
    dead = TcpProxy(upstream_host="127.0.0.1", upstream_port=1)
    await dead.start()
    await dead.refuse()  # a port of ours that nothing accepts on
    hosts = [f"127.0.0.1:{dead.port}", f"{url.host or '127.0.0.1'}:{url.port or 5432}"]
    multi = url.set(host=None, port=None).update_query_pairs(
        [("host", h) for h in hosts] + [("target_session_attrs", "read-write")]
    )
    conninfo = listener.libpq_conninfo(multi.render_as_string(hide_password=False))
    assert conninfo is not None and f"port={dead.port},{url.port or 5432}" in conninfo
    wakes: list[float] = []
    ear = listener.Listener(
        url=multi.render_as_string(hide_password=False), wake=lambda: wakes.append(1.0)
    )
    task = asyncio.create_task(ear.run())
    try:
        async with asyncio.timeout(20):
            while not ear.listening:
                await asyncio.sleep(0.02)
            listened = len(wakes)
            engine = make_engine(pg_url)
            try:
                add_rows(engine, n=1)
            finally:
                engine.dispose()
            while len(wakes) == listened:
                await asyncio.sleep(0.02)
    finally:
        ear.stop()
        await task
        await dead.close()
    assert ear.notifications >= 1
