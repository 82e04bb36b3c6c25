"""What the publisher's parts share, built once from the settings, and the named seams between
them.

Each part (claimer, sender, answers, outages, write-back, housekeeping) is given the one
:class:`Shared` and calls no other part's methods to wake it: it sets that part's named
:class:`~app.publisher.wakeup.Signal` here. The few seams that carry data are named where the
engine builds the part (the write-back's outcome buffer, the rows a write-back took away).

=========  =========================================  ====================================
seam       set by                                     wakes
=========  =========================================  ====================================
``room``   rows left the window; the connection       the claimer: room to claim, or
           changed; new rows                          something else worth a look
``news``   the listener's NOTIFY; rows made due       the claimer, waiting after a claim
                                                      that caught up
``work``   rows claimed; the window emptied; the      the sender
           connection changed; a destination reopened
``wake``   outcomes buffered (answers, sender,        the write-back
           outages); the stop
``settled`` a publish answered or lost                the stop's wait for the window
``beat``   the broker blocked or unblocked us         housekeeping: report at once
=========  =========================================  ====================================
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from app.outbox.content import Limits
from app.outbox.records import Backoff
from app.outbox.registry import PublisherRegistry
from app.outbox.store import PublisherStore
from app.publisher.dbthread import DbThread
from app.publisher.destinations import Destinations
from app.publisher.holdings import Holdings
from app.publisher.metrics import PublisherMetrics
from app.publisher.session import Session
from app.publisher.settlement import Quarantine
from app.publisher.spans import BatchSpans, batch_spans
from app.publisher.wakeup import Signal
from app.settings import Settings

#: How long an exchange found to exist is trusted before the next check.
EXCHANGE_OK_TTL = 60.0


@dataclass(eq=False)
class Shared:
    """The state and the seams every part of one publisher shares (:meth:`build`)."""

    settings: Settings
    store: PublisherStore
    registry: PublisherRegistry
    db: DbThread  # every database call, on one thread
    owner: str  # this publisher's id: the lease owner of its rows
    metrics: PublisherMetrics
    clock: Callable[[], float]  # monotonic seconds
    backoff: Backoff
    limits: Limits
    holdings: Holdings  # the rows this publisher holds, queued or published
    quarantine: Quarantine
    destinations: Destinations
    session: Session
    spans: BatchSpans | None  # OUTBOX_PUBLISHER_TRACING
    room: Signal = field(default_factory=Signal)
    news: Signal = field(default_factory=Signal)
    work: Signal = field(default_factory=Signal)
    wake: Signal = field(default_factory=Signal)
    settled: Signal = field(default_factory=Signal)
    beat: Signal = field(default_factory=Signal)

    @classmethod
    def build(
        cls,
        *,
        settings: Settings,
        store: PublisherStore,
        owner: str,
        metrics: PublisherMetrics,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> Shared:
        """Everything from the settings. The session's events go to the part that settles
        answers, attached once it is built (:meth:`Session.attach`)."""
        backoff = Backoff(base=settings.backoff_base, cap=settings.backoff_max, rng=rng)
        return cls(
            settings=settings,
            store=store,
            registry=PublisherRegistry(store.db),
            db=DbThread(claims_apart=store.db.is_postgres, clock=clock),
            owner=owner,
            metrics=metrics,
            clock=clock,
            backoff=backoff,
            limits=Limits(
                max_body_bytes=settings.max_body_bytes, max_header_bytes=settings.max_header_bytes
            ),
            holdings=Holdings(),
            quarantine=Quarantine(),
            destinations=Destinations(
                backoff=backoff,
                ok_ttl=EXCHANGE_OK_TTL,
                outage_max_wait=settings.destination_outage_max_wait,
            ),
            session=Session(
                settings=settings,
                metrics=metrics,
                name=f"outbox-publisher {owner}",
                clock=clock,
                rng=rng,
            ),
            spans=batch_spans(enabled=settings.publisher_tracing, publisher_id=owner),
        )

    def can_publish_again(self) -> None:
        """The connection, or what it may carry, changed (connected, lost, unblocked, an
        exchange check done on a publishing channel): every task that waits on it looks again."""
        self.work.set()
        self.room.set()
        self.settled.set()

    def freed(self) -> None:
        """Rows left the window: room for the claimer, news for the stop's wait."""
        self.room.set()
        self.settled.set()

    def new_rows(self) -> None:
        """Rows were committed or made due: news for the claimer."""
        self.news.set()
        self.room.set()
