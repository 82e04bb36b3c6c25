"""The outbox's four clients on one database, for tests that act as all of them at once (a
publisher claiming, an operator republishing, a purge) on one clock and one unit of work."""

from __future__ import annotations

from sqlalchemy import Engine

from app.outbox.actions import OperatorActions
from app.outbox.database import Clock, OutboxDatabase, utcnow
from app.outbox.registry import PublisherRegistry
from app.outbox.retention import Retention
from app.outbox.store import PublisherStore


class OutboxClients:
    def __init__(self, engine: Engine, *, clock: Clock = utcnow) -> None:
        self.db = OutboxDatabase(engine, clock=clock)
        self.store = PublisherStore(self.db)
        self.registry = PublisherRegistry(self.db)
        self.actions = OperatorActions(self.db)
        self.retention = Retention(self.db)
