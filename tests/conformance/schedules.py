"""Broker schedules for the confirm core: a generator, a driver that plays one on the fake broker,
and a reference model of what each row may end as.

A **schedule** is what the broker does to a handful of outbox rows: each row has a *fate* (the
broker takes it; refuses it for good, as a queue at its length limit for one routing key does;
or cannot route it), and a script of steps is played while the real publisher drains the rows:
acks and nacks, single or ``multiple``, over any outstanding tag of any channel; returns before
their answer; channel closes and connection drops or forced closes at any point; acks of settled
or unknown tags and returns of settled messages (protocol errors); ``connection.blocked``;
silence; and the outbox's database failing over (or crashing) to a copy that lacks the last
commits: the write-back that settled a recent publish's row undone, or its claim too, and the
publisher's next database call failing. When the script ends the broker turns *healthy*: it
answers everything by the rows' fates (contiguous answers of one kind as one ``multiple``
frame, so a run of refused rows is one multiple nack) until every row has ended.

The **model** (:func:`violations`) reads the broker's record of every publish and the rows'
final state. What must hold, whatever the schedule:

- a row ends, within a bound after the broker turns healthy (no row ``pending`` or
  ``in_flight`` for ever);
- ``confirmed`` only after an ack of one of its publishes that was not returned;
- ``returned`` only after a return of one of its publishes, answered past the return grace of
  its connection;
- ``nacked`` only after at least ``max_attempts`` nacks of its publishes;
- ``failed`` only for a row that was outstanding in at least ``POISON_STRIKES`` broker closes;
- by fate: a refused row ends ``nacked`` (or ``failed``), an unroutable one ``returned`` (or
  ``failed``), never ``confirmed``;
- duplicates at the broker (publishes acked and not returned, or of unknown outcome, beyond the
  first) never exceed ``lost_confirms`` (which may count more: a publish written as the
  connection died is unknown to the publisher, and never reached the broker);
- ``attempts`` counts every publish of a row whose claims the database never lost (after a
  failover to a copy without the claim, the new primary never saw that attempt, nor the
  publishes the publisher made from memory until a write-back told it the row was gone);
- no hot loop: a publish that was nacked or returned is not followed by the next publish of the
  same row sooner than the first backoff allows (unless the database lost the row's claim
  meanwhile: the backoff of a row that is no longer held has nowhere to be written), and no
  row is published more often than the script's failures explain.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from hypothesis import strategies as st

from app.publisher.settlement import POISON_STRIKES
from tests.support.fakebroker import FakeBroker, FakeConnection, Published

Fate = Literal["normal", "refused", "unroutable"]
EXCHANGES = ("a", "b")

# ---------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class RowSpec:
    exchange: str
    fate: Fate
    max_attempts: int


@dataclass(frozen=True)
class Answer:
    """ack or nack the ``pick``-th outstanding publish (and, ``multiple``, every outstanding
    tag below it on its channel). A row's fate overrides the kind: a refused row is nacked."""

    nack: bool
    pick: int
    multiple: bool


@dataclass(frozen=True)
class Return:
    """``basic.return`` of an outstanding publish, before its answer."""

    pick: int
    code: int


@dataclass(frozen=True)
class CloseChannel:
    """The broker closes the channel of an outstanding publish (504: blame the outstanding)."""

    pick: int


@dataclass(frozen=True)
class Cut:
    """The connection goes: ``drop`` cuts TCP, else a forced close (320)."""

    drop: bool


@dataclass(frozen=True)
class Junk:
    """A frame the broker must never send: an ack of a settled tag, of a tag never published, or
    a return of a settled message."""

    kind: Literal["settled", "unknown", "stale_return"]
    pick: int


@dataclass(frozen=True)
class Block:
    """``connection.blocked`` for ``seconds`` (nothing answered meanwhile), then unblocked."""

    seconds: float


@dataclass(frozen=True)
class Undo:
    """The database loses its last commits (a failover to a standby behind the primary, or a
    crash undoing commits that did not wait for the disk): the row of the ``pick``-th recent
    publish is set back to before its write-back, ``in_flight`` under the publisher's lease
    again (its confirm lost), or with ``claim`` to before its claim too (``pending``,
    nobody's, one attempt fewer). The publisher's next database call then fails, as the
    first call on a connection to the old primary does."""

    pick: int
    claim: bool


@dataclass(frozen=True)
class Pause:
    """Silence: nothing answered for ``seconds`` (publishes pile up, slow answers)."""

    seconds: float


Step = Answer | Return | CloseChannel | Cut | Junk | Block | Pause | Undo


@dataclass(frozen=True)
class Schedule:
    rows: tuple[RowSpec, ...]
    steps: tuple[Step, ...]
    window: int
    channels: int

    def __str__(self) -> str:
        rows = ", ".join(
            f"{i}:{r.exchange}/{r.fate}/{r.max_attempts}" for i, r in enumerate(self.rows)
        )
        steps = "\n  ".join(repr(s) for s in self.steps)
        return f"window {self.window}, channels {self.channels}\nrows {rows}\nsteps\n  {steps}"


_picks = st.integers(min_value=0, max_value=63)
_steps: st.SearchStrategy[Step] = st.one_of(
    st.builds(Answer, nack=st.booleans(), pick=_picks, multiple=st.booleans()),
    st.builds(Answer, nack=st.booleans(), pick=_picks, multiple=st.booleans()),  # weight x2
    st.builds(Return, pick=_picks, code=st.sampled_from([312, 313])),
    st.builds(CloseChannel, pick=_picks),
    st.builds(Cut, drop=st.booleans()),
    st.builds(Junk, kind=st.sampled_from(["settled", "unknown", "stale_return"]), pick=_picks),
    st.builds(Block, seconds=st.sampled_from([0.05, 0.2])),
    st.builds(Pause, seconds=st.sampled_from([0.01, 0.05, 0.15])),
    st.builds(Undo, pick=_picks, claim=st.booleans()),
)
_rows = st.builds(
    RowSpec,
    exchange=st.sampled_from(EXCHANGES),
    fate=st.sampled_from(["normal", "normal", "refused", "unroutable"]),
    max_attempts=st.integers(min_value=1, max_value=3),
)


def schedules(*, max_rows: int = 14, max_steps: int = 14) -> st.SearchStrategy[Schedule]:
    return st.builds(
        Schedule,
        rows=st.lists(_rows, min_size=1, max_size=max_rows).map(tuple),
        steps=st.lists(_steps, max_size=max_steps).map(tuple),
        window=st.sampled_from([1, 2, 5, 64]),
        channels=st.sampled_from([1, 2]),
    )


# ---------------------------------------------------------------------------- the broker's record


@dataclass(eq=False)
class Record:
    """One publish as the broker saw it, and what it answered."""

    pub: Published
    answer: Literal["ack", "nack"] | None = None
    answered_at: float | None = None
    returned: int | None = None  # reply code
    returned_at: float | None = None
    closes: int = 0  # broker closes (channel 504) while it was outstanding

    @property
    def message_id(self) -> str:
        return self.pub.message_id

    def age_at_answer(self) -> float:
        assert self.answered_at is not None
        return self.answered_at - self.pub.connection.opened_at


class Driver:
    """Plays a schedule on the fake broker; keeps the record the model reads."""

    def __init__(
        self,
        broker: FakeBroker,
        schedule: Schedule,
        fates: dict[str, RowSpec],
        undo: Callable[[str, bool], bool] | None = None,
    ) -> None:
        """``undo(message_id, claim)``: the database loses the row's last write-back (and its
        claim); False when there was nothing to lose."""
        self.broker = broker
        self.undo_row = undo
        #: per row: the claims (``claim``) and write-backs the database lost
        self.undone: Counter[str] = Counter()
        self.undone_claims: Counter[str] = Counter()
        self.claims_lost_at: dict[str, list[float]] = {}
        self.schedule = schedule
        self.fates = fates
        self.records: list[Record] = []
        self._seen = 0
        self.healthy = False
        #: channels that sent a frame the publisher cannot trust: it drops them, so nothing
        #: answered on them after it reaches the publisher (their publishes stay unknown)
        self._untrusted: set[int] = set()
        self._closing: set[int] = set()  # connections sent connection.close: answers go unread
        self.log: list[tuple[float, str]] = []

    # ------------------------------------------------------------ what is outstanding

    def _sync(self) -> None:
        while self._seen < len(self.broker.published):
            self.records.append(Record(self.broker.published[self._seen]))
            self._seen += 1

    def _alive(self, pub: Published) -> bool:
        conn = pub.connection
        return (
            id(pub.chan) not in self._untrusted
            and id(conn) not in self._closing
            and conn.transport is not None
            and not conn.transport.is_closing()
            and not conn.closed.done()
            and conn.channels.get(pub.channel_id) is pub.chan
            and not getattr(pub.chan, "closing", False)
        )

    def outstanding(self) -> list[Record]:
        self._sync()
        return [r for r in self.records if r.answer is None and self._alive(r.pub)]

    def _pick(self, pick: int) -> Record | None:
        out = self.outstanding()
        return out[pick % len(out)] if out else None

    # ------------------------------------------------------------ answering

    def _kind(self, rec: Record, nack: bool) -> Literal["ack", "nack"]:
        if self.fates[rec.message_id].fate == "refused":
            return "nack"
        return "nack" if nack else "ack"

    def _return(self, rec: Record, code: int = 312) -> None:
        if rec.returned is None:
            rec.returned, rec.returned_at = code, time.monotonic()
            rec.pub.send_return(code, "NO_ROUTE" if code == 312 else "NO_CONSUMERS")

    def _settle(self, recs: list[Record], kinds: dict[int, Literal["ack", "nack"]]) -> None:
        """Answer ``recs`` (one channel, all outstanding tags up to the last), runs of one kind
        as one ``multiple`` frame: the run's outstanding tags at or below its last."""
        now = time.monotonic()
        recs = sorted(recs, key=lambda r: r.pub.tag)
        for rec in recs:
            if self.fates[rec.message_id].fate == "unroutable":
                self._return(rec)
        start = 0
        while start < len(recs):
            end = start
            kind = kinds[id(recs[start])]
            while end + 1 < len(recs) and kinds[id(recs[end + 1])] == kind:
                end += 1
            last = recs[end]
            single = end == start
            frame = last.pub.nack if kind == "nack" else last.pub.ack
            frame(multiple=not single)
            for rec in recs[start : end + 1]:
                rec.answer, rec.answered_at = kind, now
            start = end + 1

    def answer(self, step: Answer) -> None:
        target = self._pick(step.pick)
        if target is None:
            return
        if step.multiple:
            recs = [
                r
                for r in self.outstanding()
                if r.pub.connection is target.pub.connection
                and r.pub.chan is target.pub.chan
                and r.pub.tag <= target.pub.tag
            ]
        else:
            recs = [target]
        kinds = {id(r): self._kind(r, step.nack) for r in recs}
        if not step.multiple:
            self._settle(recs, kinds)
            return
        # a multiple frame settles every outstanding tag at or below it: answer the ones of the
        # other kind alone first, then the rest in one frame at the highest tag of the kind
        main = kinds[id(target)]
        odd = [r for r in recs if kinds[id(r)] != main]
        for rec in odd:
            self._settle([rec], kinds)
        self._settle([r for r in recs if kinds[id(r)] == main], kinds)

    def answer_all(self) -> None:
        """Healthy: everything outstanding, by fate, channel by channel, in tag order."""
        by_channel: dict[tuple[int, int], list[Record]] = {}
        for rec in self.outstanding():
            by_channel.setdefault((id(rec.pub.connection), id(rec.pub.chan)), []).append(rec)
        for recs in by_channel.values():
            self._settle(recs, {id(r): self._kind(r, False) for r in recs})

    # ------------------------------------------------------------ the other steps

    def _connection(self) -> FakeConnection | None:
        live = [
            c
            for c in self.broker.connections
            if c.open and not c.closed.done() and id(c) not in self._closing
        ]
        return live[-1] if live else None

    def close_channel(self, step: CloseChannel) -> None:
        target = self._pick(step.pick)
        if target is None:
            return
        for rec in self.outstanding():
            if rec.pub.chan is target.pub.chan:
                rec.closes += 1
        target.pub.connection.close_channel(target.pub.channel_id, 504, "CHANNEL_ERROR - test")

    def cut(self, step: Cut) -> None:
        conn = self._connection()
        if conn is None:
            return
        self._closing.add(id(conn))
        if step.drop:
            conn.drop()
        else:
            conn.close(320, "CONNECTION_FORCED - test")

    def junk(self, step: Junk) -> None:
        self._sync()
        if step.kind == "unknown":
            target = self._pick(step.pick)
            if target is not None:
                target.pub.connection.ack(target.pub.channel_id, target.pub.chan.tag + 7)  # type: ignore[attr-defined]
                self._untrusted.add(id(target.pub.chan))
            return
        settled = [r for r in self.records if r.answer is not None and self._alive(r.pub)]
        if step.kind == "stale_return":
            # of a confirmed message only: one nacked may be published again on the same channel
            # before this frame reaches the publisher, and a return of an outstanding message_id
            # is a return like any other
            settled = [r for r in settled if r.answer == "ack" and r.returned is None]
        if not settled:
            return
        rec = settled[step.pick % len(settled)]
        self._untrusted.add(id(rec.pub.chan))
        if step.kind == "settled":
            rec.pub.ack()
        else:
            rec.pub.connection.send_return(rec.pub, 312, "NO_ROUTE")

    def undo(self, step: Undo) -> None:
        """Of the publishes of the last second (their write-backs are among the last commits),
        the ``pick``-th whose row has something to lose."""
        if self.undo_row is None:
            return
        self._sync()
        recent = [r for r in self.records if r.pub.at > time.monotonic() - 1.0]
        if not recent:
            return
        start = step.pick % len(recent)
        for rec in recent[start:] + recent[:start]:
            if self.undo_row(rec.message_id, step.claim):
                self.log.append((time.monotonic(), f"undid {rec.message_id}"))
                self.undone[rec.message_id] += 1
                if step.claim:
                    self.undone_claims[rec.message_id] += 1
                    self.claims_lost_at.setdefault(rec.message_id, []).append(time.monotonic())
                return

    async def block(self, step: Block) -> None:
        conn = self._connection()
        if conn is None:
            return
        conn.block("test alarm")
        await asyncio.sleep(step.seconds)
        if not conn.closed.done():
            conn.unblock()

    # ------------------------------------------------------------ playing

    async def _some_outstanding(self, timeout: float = 0.1) -> None:
        with contextlib.suppress(TimeoutError):
            await self.broker.wait_for(lambda: bool(self.outstanding()), timeout=timeout)

    async def play(self) -> None:
        for step in self.schedule.steps:
            if not isinstance(step, Pause | Cut | Block):
                await self._some_outstanding()
            self.log.append((time.monotonic(), repr(step)))
            if isinstance(step, Answer):
                self.answer(step)
            elif isinstance(step, Return):
                target = self._pick(step.pick)
                if target is not None:
                    self._return(target, step.code)
            elif isinstance(step, CloseChannel):
                self.close_channel(step)
            elif isinstance(step, Cut):
                self.cut(step)
            elif isinstance(step, Junk):
                self.junk(step)
            elif isinstance(step, Block):
                await self.block(step)
            elif isinstance(step, Undo):
                self.undo(step)
            elif isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
            await asyncio.sleep(0)
        self.healthy = True
        self.log.append((time.monotonic(), "healthy"))

    async def keep_healthy(self) -> None:
        """After the script: answer whatever comes, by fate, until cancelled."""
        while True:
            self.answer_all()
            await self._some_outstanding(0.02)


# ---------------------------------------------------------------------------- the model


@dataclass
class Limits:
    """The publisher's settings the model reads."""

    return_grace: float
    backoff_base: float
    #: how much later than the fake broker sent an answer the publisher may judge it: the
    #: grace is measured when the publisher reads the frame, and a process starved of CPU
    #: reads it late (5,000 schedules niced beside a CI run: one return sent 1 ms after the
    #: connection opened was judged past a 0.3 s grace)
    slack: float = 0.2


@dataclass
class RowEnd:
    """A row's final state, from the database."""

    message_id: str
    status: str
    attempts: int
    nacks: int
    lost_confirms: int


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)

    def add(self, message_id: str, text: str) -> None:
        self.problems.append(f"{message_id}: {text}")


def violations(
    *,
    ends: Iterable[RowEnd],
    records: list[Record],
    fates: dict[str, RowSpec],
    limits: Limits,
    script_failures: Counter[str],
    undone_claims: Counter[str] | None = None,
    claims_lost_at: dict[str, list[float]] | None = None,
) -> list[str]:
    """What the model forbids in this run (empty: the run conforms). ``script_failures`` per
    row: publishes refused or left unanswered, and write-backs the database lost;
    ``undone_claims``: claims of the row the database lost."""
    undone_claims = undone_claims or Counter()
    claims_lost_at = claims_lost_at or {}
    verdict = Verdict()
    by_row: dict[str, list[Record]] = {}
    for rec in records:
        by_row.setdefault(rec.message_id, []).append(rec)
    for end in ends:
        _row(
            end,
            by_row.get(end.message_id, []),
            fates[end.message_id],
            limits,
            verdict,
            script_failures,
            undone_claims[end.message_id],
            claims_lost_at.get(end.message_id, []),
        )
    return verdict.problems


def _row(
    end: RowEnd,
    pubs: list[Record],
    spec: RowSpec,
    limits: Limits,
    v: Verdict,
    script_failures: Counter[str],
    lost_claims: int = 0,
    lost_at: list[float] | None = None,
) -> None:
    mid, status = end.message_id, end.status
    acked = [p for p in pubs if p.answer == "ack" and p.returned is None]
    returned = [p for p in pubs if p.returned is not None]
    nacks = sum(p.answer == "nack" for p in pubs)
    unknown = [p for p in pubs if p.answer is None and p.returned is None]  # returned: unrouted
    closes = sum(p.closes for p in pubs)
    if status in ("pending", "in_flight"):
        v.add(mid, f"never ended: {status} after {len(pubs)} publishes, {nacks} nacks")
        return
    if status == "confirmed" and not acked:
        v.add(mid, "confirmed without an ack of an unreturned publish")
    if status == "returned":
        # judged when its answer came (or its channel went: no upper bound on when, accepted)
        # only 312 NO_ROUTE has a grace (bindings still being recovered)
        late = [
            p
            for p in returned
            if p.returned != 312
            or p.answered_at is None
            or p.age_at_answer() >= limits.return_grace - limits.slack
        ]
        if not late:
            v.add(mid, f"returned, but only within the return grace ({limits.return_grace}s)")
    if status == "nacked" and nacks < spec.max_attempts:
        v.add(mid, f"nacked after {nacks} nacks (max_attempts {spec.max_attempts})")
    if status == "failed" and closes < POISON_STRIKES:
        v.add(mid, f"failed after {closes} broker closes (poison needs {POISON_STRIKES})")
    allowed = {
        "normal": {"confirmed", "nacked", "failed"},
        "refused": {"nacked", "failed"},
        "unroutable": {"returned", "failed"},
    }[spec.fate]
    if returned:  # a return, then any answer: returned
        allowed = allowed | {"returned"}
    if status not in allowed:
        v.add(mid, f"a {spec.fate} row ended {status}")
    accepted = len(acked) + len(unknown)
    if accepted - 1 > end.lost_confirms:
        v.add(
            mid,
            f"{accepted - 1} possible duplicates at the broker, lost_confirms {end.lost_confirms}",
        )
    if not lost_claims and len(pubs) > end.attempts:
        v.add(mid, f"published {len(pubs)} times, attempts {end.attempts}")
    _no_hot_loop(mid, pubs, limits, v, script_failures[mid], lost_at or [])


def _no_hot_loop(
    mid: str,
    pubs: list[Record],
    limits: Limits,
    v: Verdict,
    failures: int,
    lost_at: list[float],
) -> None:
    first_backoff = limits.backoff_base / 2  # Backoff.delay(1) is within [base/2, base]
    for before, after in itertools.pairwise(pubs):
        if any(before.pub.at < at < after.pub.at for at in lost_at):
            continue  # its claim lost in between: its backoff had nowhere to be written
        refused = before.answer == "nack" or before.returned is not None
        if refused and before.answered_at is not None:
            gap = after.pub.at - before.answered_at
            if gap < first_backoff - 0.005:
                v.add(mid, f"published again {gap * 1000:.1f} ms after a refusal (no backoff)")
                return
    bound = 2 * failures + 12
    if len(pubs) > bound:
        v.add(mid, f"published {len(pubs)} times (bound {bound} for {failures} failures)")


def script_failures(records: list[Record]) -> Counter[str]:
    """Per row: its publishes the broker refused or left unanswered."""
    out: Counter[str] = Counter()
    for rec in records:
        if rec.answer != "ack" or rec.returned is not None:
            out[rec.message_id] += 1
    return out


def describe(records: list[Record], ends: list[RowEnd], log: list[tuple[float, str]]) -> str:
    """The run, for a failure message (times in ms from the first publish)."""
    t0 = records[0].pub.at if records else 0.0

    def ms(at: float | None) -> str:
        return "-" if at is None else f"{(at - t0) * 1000:.0f}"

    lines = ["publishes (message, connection, channel, tag, at, answer at, returned at):"]
    conns: dict[int, int] = {}
    for rec in records:
        p = rec.pub
        conn = conns.setdefault(id(p.connection), len(conns) + 1)
        lines.append(
            f"  {p.message_id} conn{conn} ch{p.channel_id} t{p.tag} @{ms(p.at)} "
            f"{rec.answer or 'unanswered'}@{ms(rec.answered_at)} "
            f"{'returned ' + str(rec.returned) + '@' + ms(rec.returned_at) if rec.returned else ''}"
        )
    lines.append("rows:")
    lines += [f"  {e}" for e in ends]
    lines.append("script:")
    lines += [f"  @{ms(at)} {what}" for at, what in log]
    return "\n".join(lines)


def fates_of(message_ids: list[str], schedule: Schedule) -> dict[str, RowSpec]:
    return dict(zip(message_ids, schedule.rows, strict=True))


def row_values(spec: RowSpec) -> dict[str, Any]:
    return {"exchange": spec.exchange, "max_attempts": spec.max_attempts}
