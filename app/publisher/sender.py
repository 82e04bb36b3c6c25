"""The sender: claimed rows -> publishes. Route (destination state), encode (the envelope),
write (one socket write per batch and channel); the confirm ledger records each publish.

Also runs the quarantine's turns: a suspect group goes out alone, once nothing else is
outstanding on the connection, and normal publishing waits meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from app.amqp.codec import OutgoingMessage
from app.amqp.connection import AMQPConnection
from app.amqp.errors import ChannelLimitError, CloseReason, WireError
from app.outbox.records import ClaimedRow
from app.publisher.destinations import DestinationState
from app.publisher.envelope import EnvelopeError, to_message
from app.publisher.outcomes import Outcomes
from app.publisher.settlement import (
    destination_reason,
    outage_reason,
    oversized_reason,
)
from app.publisher.wiring import Shared

log = logging.getLogger("app.publisher")

CHECK_TIMEOUT = 5.0
QUIESCE_TIMEOUT = 10.0  # for a publishing channel to settle before a check on it


class Sender:
    def __init__(self, shared: Shared, *, outcomes: Callable[[], Outcomes]) -> None:
        """``outcomes``: the write-back's current buffer."""
        self.p = shared
        self.outcomes = outcomes
        self.batch = max(1, shared.settings.claim_batch)
        self.limits = shared.limits
        #: The broker's max_message_size once a 406 told it (None: not known, no check).
        self.broker_max_size: int | None = None
        self.work = shared.work
        self.stopped = False

    def stop(self) -> None:
        """Finish the write in hand, then return from :meth:`run` (queued rows stay held)."""
        self.stopped = True
        self.work.set()

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        p = self.p
        while not self.stopped:
            if p.quarantine:
                await self._quarantine_turn()
                continue
            if not p.holdings.queue or not p.session.can_publish():
                await self.work.wait(1.0)
                continue
            self.route(p.holdings.take(p.session.publish_room(self.batch)))
            if p.session.write_paused:
                await p.session.drain()
            else:
                await asyncio.sleep(0)

    async def _quarantine_turn(self) -> None:
        """Send the next suspect group alone: only when nothing else is outstanding."""
        p = self.p
        if not p.session.can_publish() or p.session.outstanding() or p.quarantine.active:
            await self.work.wait(0.05)
            return
        group = p.quarantine.take()
        if group is None:
            return
        rows = p.holdings.rows(group)
        log.info(
            "publishing %d suspect row(s) alone to find which one the broker refuses", len(rows)
        )
        if not self._send(rows, self.p.clock()):
            p.quarantine.requeue(group)
            await self.work.wait(0.05)

    # ------------------------------------------------------------ routing

    def route(self, rows: list[ClaimedRow]) -> None:
        """Publish what can go now; park or back off per destination."""
        p = self.p
        now = p.clock()
        ready: list[ClaimedRow] = []
        dest = p.destinations
        for row in rows:
            state = dest.state(row.exchange, now)
            if state is DestinationState.OK:
                ready.append(row)
            elif state is DestinationState.PAUSED:
                reason = destination_reason(row.exchange, dest.reason(row.exchange))
                self.outcomes().back_off(reason, [row.id])
                p.wake.set()
            elif state is DestinationState.OUTAGE:
                self.outcomes().postpone(
                    outage_reason(row.exchange, dest.reason(row.exchange)),
                    dest.left(row.exchange, now),
                    [row.id],
                )
                p.wake.set()
            elif state is DestinationState.PROBING:
                if dest.probe(row.exchange) is None:  # this row is the probe: alone
                    dest.probing(row.exchange, row.id, now)
                    log.info(
                        "exchange %r: publishing row %d alone, to learn whether the outage is over",
                        row.exchange,
                        row.id,
                    )
                    if not self._send([row], now):
                        dest.probing(row.exchange, None, now)
                        p.holdings.put_back([row])
                else:
                    self._park(row, start_check=False)
            else:
                self._park(row, start_check=state is DestinationState.UNKNOWN)
        if ready and not self._send(ready, now):
            p.holdings.put_back(ready)

    def _park(self, row: ClaimedRow, *, start_check: bool) -> None:
        p = self.p
        p.holdings.park(row)
        if start_check:
            p.destinations.checking(row.exchange)
            p.session.spawn(self._check_exchange(row.exchange))

    async def _check_exchange(self, exchange: str) -> None:
        p = self.p
        try:
            reason = await self._exchange_exists(exchange)
        except ValueError:  # not even a valid exchange name: each row fails at encode
            reason = None
        except (WireError, TimeoutError, OSError) as exc:
            delay = p.destinations.unchecked(exchange, p.clock())
            log.warning(
                "check of exchange %r did not run (%s); again in %.1fs", exchange, exc, delay
            )
            asyncio.get_running_loop().call_later(delay, self._recheck, exchange)
            return
        if reason is None:
            p.destinations.ok(exchange, p.clock())
            self._unpark(exchange)
            return
        self.destination_failed(exchange, str(reason), [r.id for r in p.holdings.unpark(exchange)])

    async def _exchange_exists(self, exchange: str) -> CloseReason | None:
        """None when ``exchange`` exists, else the broker's reason: a passive
        ``exchange.declare`` on a scratch channel when the broker allows one more, else on a
        quiet publishing channel. Raises WireError / TimeoutError when it could not run."""
        conn = self.p.session.conn
        if conn is None or not conn.is_open:
            raise WireError("not connected")
        try:
            return await conn.exchange_exists(exchange, timeout=CHECK_TIMEOUT)
        except ChannelLimitError:
            return await self._check_on_quiet_channel(conn, exchange)

    async def _check_on_quiet_channel(
        self, conn: AMQPConnection, exchange: str
    ) -> CloseReason | None:
        """No channel to spare: pause publishing, let one channel's publishes settle, and run
        the check there (a missing exchange closes it with nothing outstanding; it reopens)."""
        session = self.p.session
        session.checking_on_channel = True
        try:
            async with asyncio.timeout(QUIESCE_TIMEOUT):
                while True:
                    ch = session.pick_channel()
                    if ch is None or conn is not session.conn:
                        raise WireError("no channel for the exchange check")
                    if ch.ledger.outstanding == 0:
                        break
                    await asyncio.sleep(0.005)
            return await conn.exchange_exists(exchange, timeout=CHECK_TIMEOUT, channel=ch.id)
        finally:
            session.checking_on_channel = False
            self.p.can_publish_again()

    def _recheck(self, exchange: str) -> None:
        self.p.destinations.recheck(exchange)
        self._unpark(exchange)

    def unpark(self, exchange: str) -> None:
        """Rows parked behind an outage's probe may go (it was confirmed, or lost)."""
        self._unpark(exchange)

    def _unpark(self, exchange: str) -> None:
        rows = self.p.holdings.unpark(exchange)
        if rows:
            self.p.holdings.put_back(rows)
            self.work.set()

    def destination_failed(self, exchange: str, reason: str, ids: list[int]) -> None:
        p = self.p
        delay = p.destinations.failed(exchange, reason, p.clock())
        p.metrics.destination_errors += 1
        log.warning(
            "exchange %r unusable (%s): its rows back off, exchange paused %.1fs",
            exchange,
            reason,
            delay,
        )
        if ids:
            self.outcomes().back_off(destination_reason(exchange, reason), ids)
            p.wake.set()

    # ------------------------------------------------------------ encoding and writing

    def _send(self, rows: list[ClaimedRow], now: float) -> bool:
        """Encode and write ``rows``; False when no channel could take them (rows untouched)."""
        p = self.p
        messages: list[OutgoingMessage] = []
        good: list[ClaimedRow] = []
        out = self.outcomes()
        cap = self.broker_max_size
        for row in rows:
            if cap is not None and isinstance(row.body, bytes) and len(row.body) > cap:
                out.fail(oversized_reason(cap), [row.id])
                continue
            try:
                messages.append(to_message(row, limits=self.limits))
                good.append(row)
            except EnvelopeError as exc:
                out.fail(str(exc), [row.id])
        if len(good) < len(rows):
            p.wake.set()
        if not good:
            return True
        result = p.session.send(good, messages, at=now, wall=p.store.db.clock())
        if result is None:
            return False
        for row, error in result.refused:
            out.fail(f"cannot encode the message: {error}", [row.id])
            p.wake.set()
        p.metrics.published += len(result.rows)
        if p.spans is not None:
            p.spans.published(result.rows)
        return True
