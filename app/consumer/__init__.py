"""The receiving end: an idempotent consumer kit (manual acks, prefetch, an inbox).

``Consumer(config=ConsumerConfig(name=..., queue=...), amqp_url=..., engine=..., handler=...)``;
``await consumer.run(stop)``. The handler gets a :class:`Message` and the kit's database
connection; its writes and the inbox row commit together, then the delivery is acknowledged.
``outbox consume QUEUE --handler module:function`` runs one from the command line. A RabbitMQ
stream is read the same way, with the same inbox: :class:`~app.consumer.streams.StreamConsumer`
(``outbox consume --stream STREAM``).

The names below load on first use (PEP 562): ``import app.consumer.acks`` (pure) does not pull in
aio-pika and SQLAlchemy through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.consumer.acks import Ack, AckTracker
    from app.consumer.config import ConsumerConfig, ConsumerMetrics
    from app.consumer.inbox import BatchHandler, Handler, Message, handle_once, purge_inbox
    from app.consumer.kit import Consumer, consumer_engine, registry_for
    from app.consumer.streams import StreamConsumer

_HOME = {
    "Ack": "acks",
    "AckTracker": "acks",
    "BatchHandler": "inbox",
    "Handler": "inbox",
    "Message": "inbox",
    "handle_once": "inbox",
    "purge_inbox": "inbox",
    "Consumer": "kit",
    "ConsumerConfig": "config",
    "ConsumerMetrics": "config",
    "consumer_engine": "kit",
    "registry_for": "kit",
    "StreamConsumer": "streams",
}

__all__ = [
    "Ack",
    "AckTracker",
    "BatchHandler",
    "Consumer",
    "ConsumerConfig",
    "ConsumerMetrics",
    "Handler",
    "Message",
    "StreamConsumer",
    "consumer_engine",
    "handle_once",
    "purge_inbox",
    "registry_for",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
