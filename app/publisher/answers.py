"""The broker's answers to publishes: from the session's ledger events to the write-back's
outcomes. With this module, a confirm's whole path reads in order:

1. :mod:`app.publisher.sender` writes a batch through :meth:`Session.send`; the channel's
   ledger (:class:`app.confirms.ChannelLedger`, pure) gives each row its delivery tag.
2. :mod:`app.publisher.session` hears ``basic.ack``/``basic.nack``/``basic.return`` and channel
   closes on the wire; the ledger turns each into events (``Confirmed``, ``Nacked``,
   ``Returned``, ``Lost``) for exactly the rows they settle, ``multiple`` and out-of-order
   answers included, and calls :meth:`Answers.answered` or :meth:`Answers.lost`.
3. Here: the confirm latency is observed; nacks go to :class:`~app.publisher.outages.Outages`
   (an exchange's outage, or charged to the rows); ``312 NO_ROUTE`` returns soon after a
   connect are held back to be published again; the rest is settled by the pure
   :func:`~app.publisher.settlement.settle` (or :func:`~app.publisher.settlement.lose` for a
   close) into the write-back's outcome buffer, and the write-back is woken.
4. :mod:`app.publisher.writeback` writes the buffered outcomes in one unit of work
   (:meth:`PublisherStore.mark_confirmed` and the others, each lease-guarded), then lets the
   rows leave the window.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from app.confirms import Confirmed, Event, Lost, Nacked
from app.publisher.outages import Outages
from app.publisher.outcomes import Outcomes
from app.publisher.sender import Sender
from app.publisher.settlement import CloseCause, early_return_reason, early_returns, lose, settle
from app.publisher.wiring import Shared

log = logging.getLogger("app.publisher")


class Answers:
    """The session's listener (:class:`~app.publisher.session.SessionEvents`), on the loop."""

    def __init__(
        self,
        shared: Shared,
        *,
        outages: Outages,
        sender: Sender,
        outcomes: Callable[[], Outcomes],
    ) -> None:
        self.p = shared
        self.outages = outages
        self.sender = sender
        self.outcomes = outcomes  # the write-back's current buffer
        self._early_logged: float | None = None  # the connection whose early returns were logged

    def answered(self, events: list[Event]) -> None:
        """basic.ack / basic.nack settled publishes."""
        now = self.p.clock()
        self._observe_latency(events, now)
        m = self.p.metrics
        m.nacked += sum(len(e.row_ids) for e in events if isinstance(e, Nacked))
        events = self._hold_back_early_returns(events)
        tally = settle(self.outages.answered(events), self.outcomes(), self.p.quarantine)
        m.confirmed += tally.confirmed
        m.returned += tally.returned
        self.p.wake.set()
        if not self.p.session.outstanding():
            self.p.settled.set()
            self.p.work.set()

    def lost(self, events: list[Event], cause: CloseCause) -> None:
        """A channel or the connection went away with publishes outstanding."""
        events = self._hold_back_early_returns(events)
        tally = lose(
            events,
            self.outcomes(),
            cause=cause,
            rows=self.p.holdings.held,
            quarantine=self.p.quarantine,
        )
        self.outages.lost([i for e in events if isinstance(e, Lost) for i in e.row_ids])
        m = self.p.metrics
        m.returned += tally.returned
        m.lost_confirms += tally.lost + len(tally.resent)
        m.failed += tally.oversized
        if tally.resent:
            self.p.holdings.bump_attempts(tally.resent)
        for row_id in tally.poison:
            m.poison += 1
            row = self.p.holdings.held.get(row_id)
            log.error(
                "row %d (message_id %r) fails as poison: the broker closed its channel or "
                "connection every time it was published alone",
                row_id,
                row.message_id if row else None,
            )
        if tally.paused is not None:
            self.sender.destination_failed(tally.paused, tally.paused_reason, [])
        if cause.max_size is not None:
            known = self.sender.broker_max_size
            if known is None or cause.max_size < known:
                log.warning(
                    "the broker refuses bodies over %d bytes (max_message_size): larger "
                    "rows fail with that reason",
                    cause.max_size,
                )
                self.sender.broker_max_size = cause.max_size
        self.p.wake.set()
        self.p.settled.set()
        self.p.work.set()

    def _hold_back_early_returns(self, events: list[Event]) -> list[Event]:
        """``312 NO_ROUTE`` returns within ``return_grace`` of connecting: the rows go back to
        be published again after a backoff (per row, growing with its attempts), nothing spent;
        the other events are returned for settlement."""
        grace = self.p.settings.return_grace
        events, early = early_returns(events, in_grace=self.p.session.connection_age() < grace)
        if not early:
            return events
        out, held = self.outcomes(), self.p.holdings.held
        for event in early:
            row = held.get(event.row_id)
            delay = self.p.backoff.delay(row.attempts if row is not None else 1)
            out.postpone(early_return_reason(event, grace), delay, [event.row_id])
        self.p.quarantine.settled(e.row_id for e in early)
        self.outages.lost([e.row_id for e in early])
        self.p.metrics.returns_retried += len(early)
        connected_at = self.p.session.connected_at
        log_at = logging.WARNING if self._early_logged != connected_at else logging.DEBUG
        self._early_logged = connected_at
        log.log(
            log_at,
            "%d publishes returned %s within %.1fs of connecting (return_grace %gs): the broker "
            "may still be recovering its bindings; published again with backoff",
            len(early),
            f"{early[0].reply_code} {early[0].reply_text}",
            self.p.session.connection_age(),
            grace,
        )
        return events

    def connection_changed(self) -> None:
        self.p.can_publish_again()

    def blocked_changed(self) -> None:
        self.p.beat.set()
        self.connection_changed()

    def _observe_latency(self, events: list[Event], now: float) -> None:
        """Confirmed rows, grouped by their publish write: one observation per group."""
        hist = self.p.metrics.confirm_latency
        for event in events:
            if not isinstance(event, Confirmed):
                continue
            last_at, run = -1.0, 0
            for facts in event.sent:
                at = facts[3]
                if at != last_at and run:
                    hist.observe_many(max(0.0, now - last_at), run)
                    run = 0
                last_at, run = at, run + 1
            if run:
                hist.observe_many(max(0.0, now - last_at), run)
