"""Topology for a scenario (exchanges, queues, bindings) on the private broker, through aiormq."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiormq
from aiormq.abc import AbstractChannel


@contextlib.asynccontextmanager
async def channel(amqp_url: str) -> AsyncIterator[AbstractChannel]:
    conn = await asyncio.wait_for(aiormq.connect(amqp_url), timeout=10)
    try:
        yield await conn.channel()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), timeout=5)


@dataclass
class Topology:
    """Durable direct exchanges and durable queues, with bindings ``(exchange, queue, key)``."""

    exchanges: list[str] = field(default_factory=list)
    queues: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> arguments
    bindings: list[tuple[str, str, str]] = field(default_factory=list)
    #: queues another consumer owns (the consumer kit's): the verifier leaves them alone
    unverified: tuple[str, ...] = ()

    @property
    def verified(self) -> tuple[str, ...]:
        return tuple(q for q in self.queues if q not in self.unverified)

    async def declare(self, amqp_url: str) -> None:
        async with channel(amqp_url) as ch:
            for name in self.exchanges:
                await ch.exchange_declare(name, exchange_type="direct", durable=True)
            for name, args in self.queues.items():
                await ch.queue_declare(name, durable=True, arguments=dict(args))
            for exchange, queue, key in self.bindings:
                await ch.queue_bind(queue, exchange, routing_key=key)

    async def delete(self, amqp_url: str) -> None:
        for name in self.queues:
            with contextlib.suppress(Exception):
                async with channel(amqp_url) as ch:
                    await ch.queue_delete(name)
        for name in self.exchanges:
            with contextlib.suppress(Exception):
                async with channel(amqp_url) as ch:
                    await ch.exchange_delete(name)


async def delete_exchange(amqp_url: str, name: str) -> None:
    async with channel(amqp_url) as ch:
        await ch.exchange_delete(name)


async def unbind(amqp_url: str, *, queue: str, exchange: str, key: str) -> None:
    async with channel(amqp_url) as ch:
        await ch.queue_unbind(queue, exchange, routing_key=key)
