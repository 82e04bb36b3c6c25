"""The receiving end: an idempotent consumer kit (manual acks, prefetch, an inbox).

``Consumer(config=ConsumerConfig(name=..., queue=...), amqp_url=..., engine=..., handler=...)``;
``await consumer.run(stop)``. The handler gets a :class:`Message` and the kit's database
connection; its writes and the inbox row commit together, then the delivery is acknowledged.
``outbox consume QUEUE --handler module:function`` runs one from the command line.
"""

from app.consumer.acks import Ack, AckTracker
from app.consumer.inbox import BatchHandler, Handler, Message, handle_once, purge_inbox
from app.consumer.kit import (
    Consumer,
    ConsumerConfig,
    ConsumerMetrics,
    consumer_engine,
    registry_for,
)

__all__ = [
    "Ack",
    "AckTracker",
    "BatchHandler",
    "Consumer",
    "ConsumerConfig",
    "ConsumerMetrics",
    "Handler",
    "Message",
    "consumer_engine",
    "handle_once",
    "purge_inbox",
    "registry_for",
]
