"""``outbox declare``: the exchange (and optionally a queue bound to it) that an outbox writes to,
declared durable on the broker, so that a first run does not end every row ``failed`` with
``404 NOT_FOUND``; and the streams rows name (``x-queue-type: stream``), with their retention.
Uses the publisher's own connection code: amqps, client certificates and failover hosts work the
same (``OUTBOX_AMQP_URL``). Declaring what exists with the same
arguments changes nothing; other arguments are the broker's ``406 PRECONDITION_FAILED``.
"""

from __future__ import annotations

import re
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


#: RabbitMQ's own bound on ``x-stream-max-segment-size-bytes`` (3 GB; it refuses more with 406)
MAX_SEGMENT_BYTES = 3_000_000_000
#: ``x-max-age`` as RabbitMQ takes it: a count and one unit, Y(ears), M(onths), D(ays), h, m, s
MAX_AGE = re.compile(r"[1-9][0-9]*[YMDhms]")
_BYTE_UNITS = {"": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"500000000"``, ``"500MB"``, ``"20GB"`` (decimal units, as RabbitMQ's own docs write
    them) as a number of bytes; ValueError for anything else."""
    found = re.fullmatch(r"\s*([0-9]+)\s*([kKmMgGtT][bB])?\s*", text)
    if found is None:
        raise ValueError(f"{text!r} is not a size: expected bytes, or a number with kB, MB, GB, TB")
    return int(found[1]) * _BYTE_UNITS[(found[2] or "").lower()]


def stream_arguments(
    *,
    max_length_bytes: int | None = None,
    max_age: str | None = None,
    max_segment_size_bytes: int | None = None,
    initial_cluster_size: int | None = None,
) -> common.FieldTable:
    """The ``queue.declare`` arguments of a stream: retention by size (``x-max-length-bytes``,
    whole segments of ``x-stream-max-segment-size-bytes`` are dropped from its head once the
    stream is larger) and by age (``x-max-age``, e.g. ``7D``, ``24h``), and, on a cluster, how
    many nodes hold it (``x-initial-cluster-size``: a leader and its replicas). ValueError,
    saying which, for a value RabbitMQ would refuse."""
    args: common.FieldTable = {"x-queue-type": "stream"}
    if max_length_bytes is not None:
        if max_length_bytes < 1:
            raise ValueError(f"max-length-bytes {max_length_bytes}: expected 1 or more")
        args["x-max-length-bytes"] = max_length_bytes
    if max_age is not None:
        if MAX_AGE.fullmatch(max_age) is None:
            raise ValueError(
                f"max-age {max_age!r}: expected a count and a unit, Y M D h m or s (7D, 24h)"
            )
        args["x-max-age"] = max_age
    if max_segment_size_bytes is not None:
        if not 1 <= max_segment_size_bytes <= MAX_SEGMENT_BYTES:
            raise ValueError(
                f"stream-max-segment-size-bytes {max_segment_size_bytes}: expected 1 to "
                f"{MAX_SEGMENT_BYTES} (RabbitMQ's bound)"
            )
        args["x-stream-max-segment-size-bytes"] = max_segment_size_bytes
    if initial_cluster_size is not None:
        if initial_cluster_size < 1:
            raise ValueError(f"initial cluster size {initial_cluster_size}: expected 1 or more")
        args["x-initial-cluster-size"] = initial_cluster_size
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


@dataclass(frozen=True, slots=True)
class DeclaredStream:
    stream: str
    #: the arguments it was declared with (``x-queue-type`` aside): the broker compared them
    arguments: dict[str, object]


async def declare_streams(
    url: str, *, streams: Sequence[str], arguments: common.FieldTable, timeout: float = 10.0
) -> list[DeclaredStream]:
    """Declare each of ``streams`` (durable, ``arguments`` from :func:`stream_arguments`) through
    AMQP 0-9-1, the publisher's own connection code. One that exists with the same arguments is
    left as it is; with others, the broker closes the channel (406 PRECONDITION_FAILED,
    ``inequivalent arg``): :class:`~app.amqp.errors.ChannelClosedError`, and the streams after
    it are not declared."""
    conn = await AMQPConnection.connect(
        url, listener=_Quiet(), timeout=timeout, name="outbox-declare"
    )
    done: list[DeclaredStream] = []
    try:
        ch = await conn.open_channel(confirm=False)
        for name in streams:
            await conn.call(
                ch,
                commands.Queue.Declare(queue=name, durable=True, arguments=arguments),
                (commands.Queue.DeclareOk,),
                timeout=timeout,
            )
            shown: dict[str, object] = {
                k: v for k, v in (arguments or {}).items() if k != "x-queue-type"
            }
            done.append(DeclaredStream(stream=name, arguments=shown))
        return done
    finally:
        await conn.close()
