"""Operators' actions on rows: republish what failed and skip a terminal failure, each audited
(who, from where, why, what moved) and replay-safe by request id; and the rules for an
operator's own texts, checked alike by the API, the console and the CLI."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Required, TypedDict, Unpack

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    and_,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from app.outbox.database import OutboxDatabase
from app.outbox.read.scopes import scope_conditions
from app.outbox.schema import audit, events, outbox
from app.outbox.scope import RepublishFilter
from app.outbox.shown import kept_reasons
from app.outbox.states import TERMINAL_FAILURES, Status, check_transition

#: The texts an operator gives for the audit trail (who acts, why a row is skipped) are one line
#: without these characters (NUL, which PostgreSQL's text refuses, and the controls that would
#: forge lines in logs and tables), checked alike by the API, the console and the CLI. A regular
#: expression character class, without its brackets.
CONTROL_CHARACTERS = r"\x00-\x1f\x7f"
MAX_ACTOR = 64
MAX_REASON = 1000
#: What an operator's text (an actor name, a reason: kept in the audit trail, logged, shown)
#: may not hold: C0 and C1 controls (``\x85`` split a JSON log line), the line and paragraph
#: separators U+2028/U+2029, and the bidirectional embeddings, overrides and isolates (a reason
#: that reads otherwise than it is stored).
OPERATOR_TEXT_FORBIDDEN = r"\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[{OPERATOR_TEXT_FORBIDDEN}]")


def has_control_characters(text: str) -> bool:
    """An operator text holding a character of :data:`OPERATOR_TEXT_FORBIDDEN`."""
    return _CONTROL.search(text) is not None


@dataclass(frozen=True, slots=True)
class RepublishResult:
    dry_run: bool
    count: int
    matched: int
    sample: list[str]
    audit_id: int | None
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class SkipResult:
    """An operator skipped a terminal failure: it will not be delivered, its key goes on."""

    message_id: str
    previous: Status
    ordering_key: str | None
    released: int  # rows of its key that were waiting behind it
    audit_id: int


def _as_it_was() -> list[Any]:
    """A row's columns as an operator's event records it before the action."""
    return [
        outbox.c.id,
        outbox.c.message_id,
        outbox.c.status,
        outbox.c.ordering_key,
        outbox.c.attempts,
        outbox.c.reply_code,
        *kept_reasons(),
    ]


def _waiting_behind(conn: Connection, found: Any) -> int:
    """The pending rows of ``found``'s ordering key after it: what a skip releases."""
    if found.ordering_key is None:
        return 0
    return int(
        conn.execute(
            select(func.count())
            .select_from(outbox)
            .where(
                outbox.c.ordering_key == found.ordering_key,
                outbox.c.id > found.id,
                outbox.c.status == Status.PENDING,
            )
        ).scalar_one()
    )


class CannotSkip(ValueError):
    """The row does not exist or is not a terminal failure (nothing changed)."""


class RequestIdReused(ValueError):
    """A republish request id already names another action, filter or limit (nothing moved):
    repeating an id replays its first result only when the request is the same."""

    def __init__(self, request_id: str, audit_id: int) -> None:
        super().__init__(
            f"request_id {request_id!r} was already used (audit row {audit_id}) "
            "with a different filter or limit; choose a new request_id"
        )
        self.audit_id = audit_id


class Acting(TypedDict, total=False):
    """Who acts, for the audit row: ``actor`` as the caller names itself, ``principal`` as the
    server verified it (a token's name, the CLI's OS user), ``client_addr`` where from."""

    actor: Required[str]
    principal: str | None
    client_addr: str | None


class OperatorActions:
    """Republish and skip: the operator's writes to the outbox."""

    def __init__(self, db: OutboxDatabase | Engine) -> None:
        self.db = OutboxDatabase.of(db)

    def republish(
        self,
        *,
        filter: RepublishFilter,
        limit: int,
        dry_run: bool,
        request_id: str | None = None,
        **who: Unpack[Acting],
    ) -> RepublishResult:
        """Move terminal-failure rows matching ``filter`` back to ``pending``, with an audit row.

        ``dry_run`` counts and samples, changes nothing. A ``request_id`` seen before returns that
        run's result again and moves nothing (safe to retry an operator call) when the filter and
        the limit are the same, and raises :class:`RequestIdReused` otherwise (a dry run too).
        The id is read in the transaction that moves the rows, and its audit row is written
        there under a unique constraint: of two concurrent calls with one id, the loser's moves
        are rolled back and it is compared with the winner's row, never answered its result.
        """
        if limit < 1:
            raise ValueError("limit must be at least 1")
        try:
            return self._republish(
                flt=filter, limit=limit, dry_run=dry_run, request_id=request_id, who=who
            )
        except IntegrityError:  # a concurrent call with the same request id won the race
            if request_id is None:
                raise
            with self.db.engine.connect() as conn:
                previous = self._replay(conn, request_id, flt=filter, limit=limit)
            if previous is None:
                raise
            return previous

    def _replay(
        self, conn: Connection, request_id: str, *, flt: RepublishFilter, limit: int
    ) -> RepublishResult | None:
        """The first result of ``request_id`` when this request is the same; None if unused."""
        stmt = select(audit.c.id, audit.c.action, audit.c.filter, audit.c.result)
        row = conn.execute(stmt.where(audit.c.request_id == request_id)).first()
        if row is None:
            return None
        res = row.result or {}
        same_limit = res.get("limit", limit) == limit  # rows from before the limit was kept
        if row.action != "republish" or row.filter != flt.as_json() or not same_limit:
            raise RequestIdReused(request_id, int(row.id))
        return RepublishResult(
            dry_run=False,
            count=res.get("count", 0),
            matched=res.get("matched", 0),
            sample=res.get("sample", []),
            audit_id=row.id,
            replayed=True,
        )

    def _filter_cond(self, flt: RepublishFilter) -> ColumnElement[bool]:
        return and_(*scope_conditions(flt))

    def _republish(
        self,
        *,
        flt: RepublishFilter,
        limit: int,
        dry_run: bool,
        request_id: str | None,
        who: Acting,
    ) -> RepublishResult:
        cond = self._filter_cond(flt)
        pick = select(*_as_it_was()).where(cond).order_by(outbox.c.id).limit(limit)
        if self.db.is_postgres and not dry_run:
            pick = pick.with_for_update(skip_locked=True)
        with self.db.begin() as conn:
            previous = (
                None if request_id is None else self._replay(conn, request_id, flt=flt, limit=limit)
            )
            if previous is not None and not dry_run:
                return previous
            matched = int(conn.execute(select(func.count()).where(cond)).scalar_one())
            rows = conn.execute(pick).all()
            sample = [r.message_id for r in rows[:20]]
            if dry_run:
                return RepublishResult(
                    dry_run=True, count=len(rows), matched=matched, sample=sample, audit_id=None
                )
            ids = self._back_to_pending(conn, rows, cond)
            result = {"count": len(ids), "matched": matched, "sample": sample, "limit": limit}
            self.db.notify_new(conn)
            audit_id = self.db.audit(
                conn,
                action="republish",
                request_id=request_id,
                filter=flt.as_json(),
                count=len(ids),
                result=result,
                **who,
            )
            self._operator_events(
                conn, rows, kind="republished", actor=who["actor"], audit_id=int(audit_id)
            )
        return RepublishResult(
            dry_run=False, count=len(ids), matched=matched, sample=sample, audit_id=int(audit_id)
        )

    def _back_to_pending(
        self, conn: Connection, rows: Sequence[Any], cond: ColumnElement[bool]
    ) -> list[int]:
        """Put ``rows`` (still matching ``cond``) back to ``pending`` with fresh budgets."""
        for status in {Status(r.status) for r in rows}:
            check_transition(status, Status.PENDING)
        ids = [r.id for r in rows]
        for chunk in self.db.chunks(ids):
            conn.execute(
                update(outbox)
                .where(self.db.ids_in(chunk), cond)
                .values(
                    status=Status.PENDING,
                    attempts=0,
                    nacks=0,
                    # a stream row goes out under a new publishing id: its old one is spent
                    # (docs/streams.md: a republish may append the message again, on purpose)
                    stream_seq=None,
                    available_at=self.db.clock(),
                    last_error=None,
                    reply_code=None,
                    reply_text=None,
                )
            )
        return ids

    def _operator_events(
        self,
        conn: Connection,
        rows: Sequence[Any],
        *,
        kind: str,
        actor: str,
        audit_id: int,
        detail: str | None = None,
    ) -> None:
        """An operator's republish or skip, one event per row, as the row was before it."""
        at = self.db.clock()
        if rows:
            conn.execute(
                insert(events),
                [
                    {
                        "outbox_id": r.id,
                        "message_id": r.message_id,
                        "at": at,
                        "kind": kind,
                        "from_status": r.status,
                        "attempt": r.attempts,
                        "reply_code": r.reply_code,
                        "detail": detail if detail is not None else (r.last_error or r.reply_text),
                        "actor": actor,
                        "audit_id": audit_id,
                    }
                    for r in rows
                ],
            )

    def _skippable(self, conn: Connection, message_id: str, sources: list[str]) -> Any:
        """The row to skip, locked; :class:`CannotSkip` unless it is a terminal failure."""
        pick = select(*_as_it_was()).where(outbox.c.message_id == message_id)
        found = conn.execute(pick.with_for_update() if self.db.is_postgres else pick).first()
        if found is None:
            raise CannotSkip(f"no row with message_id {message_id!r}")
        if found.status not in sources:
            raise CannotSkip(
                f"{message_id!r} is {found.status}: only a terminal failure "
                f"({', '.join(sorted(sources))}) can be skipped"
            )
        return found

    def skip(self, *, message_id: str, reason: str, **who: Unpack[Acting]) -> SkipResult:
        """Mark one terminal failure ``skipped`` (audited with ``reason``): it will not be
        delivered, and the later rows of its ordering key, parked behind it, are released."""
        actor, reason = who["actor"], reason.strip()
        if not reason:
            raise CannotSkip("a skip needs a reason (it is kept in the audit trail)")
        sources = [s.value for s in TERMINAL_FAILURES]
        for source in TERMINAL_FAILURES:
            check_transition(source, Status.SKIPPED)
        with self.db.begin() as conn:
            found = self._skippable(conn, message_id, sources)
            conn.execute(
                update(outbox)
                .where(outbox.c.id == found.id, outbox.c.status.in_(sources))
                .values(status=Status.SKIPPED, last_error=f"skipped by {actor}: {reason}")
            )
            released = _waiting_behind(conn, found)
            if released:
                self.db.notify_new(conn)
            result = {
                "message_id": message_id,
                "previous": found.status,
                "ordering_key": found.ordering_key,
                "released": released,
            }
            audit_id = self.db.audit(
                conn,
                action="skip",
                filter={"message_id": message_id, "reason": reason},
                count=1,
                result=result,
                **who,
            )
            self._operator_events(
                conn, [found], kind="skipped", actor=actor, audit_id=int(audit_id), detail=reason
            )
        return SkipResult(
            message_id=message_id,
            previous=Status(found.status),
            ordering_key=found.ordering_key,
            released=released,
            audit_id=int(audit_id),
        )
