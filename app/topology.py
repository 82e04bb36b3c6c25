"""``outbox declare``: the exchange (and optionally a queue bound to it) that an outbox writes to,
declared durable on the broker, so that a first run does not end every row ``failed`` with
``404 NOT_FOUND``. Uses the publisher's own connection code: amqps, client certificates and
failover hosts work the same (``OUTBOX_AMQP_URL``). Declaring what exists with the same
arguments changes nothing; other arguments are the broker's ``406 PRECONDITION_FAILED``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pamqp import commands

from app.amqp.codec import ReturnedMessage
from app.amqp.connection import AMQPConnection
from app.amqp.errors import CloseReason

KINDS = ("direct", "topic", "fanout", "headers")


class _Quiet:
    """A declare-only connection publishes nothing: it has nothing to hear."""

    def on_ack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None: ...
    def on_nack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None: ...
    def on_return(self, channel_id: int, message: ReturnedMessage) -> None: ...
    def on_channel_closed(self, channel_id: int, reason: CloseReason) -> None: ...
    def on_blocked(self, reason: str) -> None: ...
    def on_unblocked(self) -> None: ...
    def on_connection_lost(self, reason: CloseReason) -> None: ...


@dataclass(frozen=True, slots=True)
class Declared:
    exchange: str
    kind: str
    queue: str | None = None
    bindings: list[str] = field(default_factory=list)
    queue_messages: int | None = None


async def declare(
    url: str, *, exchange: str, kind: str = "topic", queue: str | None = None,
    bindings: Sequence[str] = (), timeout: float = 10.0,
) -> Declared:  # fmt: skip
    """Declare ``exchange`` (durable) and, when given, ``queue`` (durable, classic) bound to it
    with each of ``bindings`` (``#`` when none is given for a topic exchange, ``""`` else)."""
    conn = await AMQPConnection.connect(url, listener=_Quiet(), timeout=timeout,
                                        name="outbox-declare")  # fmt: skip
    try:
        ch = await conn.open_channel(confirm=False)
        await conn.call(ch, commands.Exchange.Declare(exchange=exchange, exchange_type=kind,
                                                      durable=True),
                        (commands.Exchange.DeclareOk,), timeout=timeout)  # fmt: skip
        if queue is None:
            return Declared(exchange=exchange, kind=kind)
        ok = await conn.call(ch, commands.Queue.Declare(
            queue=queue, durable=True, arguments={"x-queue-type": "classic"},
        ), (commands.Queue.DeclareOk,), timeout=timeout)  # fmt: skip
        keys = list(bindings) or ["#" if kind == "topic" else ""]
        for key in keys:
            await conn.call(ch, commands.Queue.Bind(queue=queue, exchange=exchange,
                                                    routing_key=key),
                            (commands.Queue.BindOk,), timeout=timeout)  # fmt: skip
        count = getattr(ok, "message_count", None)
        return Declared(exchange=exchange, kind=kind, queue=queue, bindings=keys,
                        queue_messages=count)  # fmt: skip
    finally:
        await conn.close()
