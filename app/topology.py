"""``outbox declare``: the exchange (and optionally a queue bound to it) that an outbox writes to,
declared durable on the broker, so that a first run does not end every row ``failed`` with
``404 NOT_FOUND``. Uses the publisher's own connection code: amqps, client certificates and
failover hosts work the same (``OUTBOX_AMQP_URL``). Declaring what exists with the same
arguments changes nothing; other arguments are the broker's ``406 PRECONDITION_FAILED``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pamqp import commands, common

from app.amqp.connection import AMQPConnection

KINDS = ("direct", "topic", "fanout", "headers")
#: ``classic``: one node holds the queue (a single broker, or messages that may be lost with a
#: node). ``quorum``: replicated on a majority (Raft); a confirm means a majority wrote it.
QUEUE_TYPES = ("classic", "quorum")


def queue_arguments(
    queue_type: str = "classic", *, delivery_limit: int | None = None
) -> common.FieldTable:
    """The ``queue.declare`` arguments of a queue of ``queue_type``; ``delivery_limit`` (quorum
    only) is the broker's ``x-delivery-limit``: past it the broker dead-letters (or drops) the
    message itself."""
    if queue_type not in QUEUE_TYPES:
        raise ValueError(f"queue type {queue_type!r}: expected one of {', '.join(QUEUE_TYPES)}")
    args: common.FieldTable = {"x-queue-type": queue_type}
    if delivery_limit is not None:
        if queue_type != "quorum":
            raise ValueError("a delivery limit needs a quorum queue (--queue-type quorum)")
        if delivery_limit < 1:
            raise ValueError(f"delivery limit {delivery_limit}: expected 1 or more")
        args["x-delivery-limit"] = delivery_limit
    return args


class _Quiet:
    """A declare-only connection publishes nothing: it has nothing to hear."""

    def _ignore(self, *_: object, **__: object) -> None:
        """Whatever the broker says, unasked: nothing to do."""

    on_ack = on_nack = on_return = on_channel_closed = _ignore
    on_blocked = on_unblocked = on_connection_lost = _ignore


@dataclass(frozen=True, slots=True)
class Declared:
    exchange: str
    kind: str
    queue: str | None = None
    bindings: list[str] = field(default_factory=list)
    queue_messages: int | None = None
    queue_type: str | None = None
    delivery_limit: int | None = None


async def declare(
    url: str,
    *,
    exchange: str,
    kind: str = "topic",
    queue: str | None = None,
    bindings: Sequence[str] = (),
    timeout: float = 10.0,
    queue_type: str = "classic",
    delivery_limit: int | None = None,
) -> Declared:
    """Declare ``exchange`` (durable) and, when given, ``queue`` (durable, ``queue_type``: see
    :func:`queue_arguments`) bound to it with each of ``bindings`` (``#`` when none is given for
    a topic exchange, ``""`` else)."""
    arguments = queue_arguments(queue_type, delivery_limit=delivery_limit)
    conn = await AMQPConnection.connect(
        url, listener=_Quiet(), timeout=timeout, name="outbox-declare"
    )
    try:
        ch = await conn.open_channel(confirm=False)
        await conn.call(
            ch,
            commands.Exchange.Declare(exchange=exchange, exchange_type=kind, durable=True),
            (commands.Exchange.DeclareOk,),
            timeout=timeout,
        )
        if queue is None:
            return Declared(exchange=exchange, kind=kind)
        ok = await conn.call(
            ch,
            commands.Queue.Declare(
                queue=queue,
                durable=True,
                arguments=arguments,
            ),
            (commands.Queue.DeclareOk,),
            timeout=timeout,
        )
        keys = list(bindings) or ["#" if kind == "topic" else ""]
        for key in keys:
            await conn.call(
                ch,
                commands.Queue.Bind(queue=queue, exchange=exchange, routing_key=key),
                (commands.Queue.BindOk,),
                timeout=timeout,
            )
        count = getattr(ok, "message_count", None)
        return Declared(
            exchange=exchange,
            kind=kind,
            queue=queue,
            bindings=keys,
            queue_messages=count,
            queue_type=queue_type,
            delivery_limit=delivery_limit,
        )
    finally:
        await conn.close()
