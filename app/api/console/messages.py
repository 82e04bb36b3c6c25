"""Message search and one message: its history, its body."""

from __future__ import annotations

import codecs
import datetime as dt
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse

from app.api.console.base import (
    MAX_FIELD,
    PAGE,
    REPUBLISH_STATUSES,
    ConsoleError,
    Step,
    check_path_id,
    int_param,
    page_router,
    render,
    scope_fields,
    search_scope,
    session_of,
)
from app.api.context import get_ctx
from app.outbox.read.audit import audit_trail
from app.outbox.read.messages import (
    MessageEvent,
    MessageRecord,
    message_events,
    search_messages,
)
from app.outbox.read.messages import message as read_message
from app.outbox.read.scopes import SEARCH_WINDOW, count_scope, search_window
from app.outbox.scope import Scope
from app.outbox.states import TERMINAL_FAILURES, Status

router = page_router()


@router.get("/messages")
def messages(request: Request) -> HTMLResponse:
    session = session_of(request)
    scope, shown = search_scope(request)
    ctx = get_ctx(request)
    engine = ctx.engine
    bounded = search_window(scope, now=ctx.now())
    if bounded is not None:  # links and republish carry the window the page searched
        scope = bounded
        assert bounded.created_after is not None
        shown["created_after"] = bounded.created_after.isoformat()
    after = int_param(request, "after")
    page = search_messages(engine, flt=scope, limit=PAGE, after=after)
    total, more_than = count_scope(engine, flt=scope)
    found = page.items
    more = page.truncated or len(found) == PAGE
    nxt = {**shown, "after": found[-1].id} if more and found else None
    return render(
        request,
        "messages.html",
        session=session,
        found=found,
        shown=shown,
        status=next(iter(scope.statuses), None),
        statuses=list(Status),
        fields=shown,
        next=nxt,
        total=total,
        more_than=more_than,
        described=scope.describe(),
        windowed=bounded is not None,
        window_hours=int(SEARCH_WINDOW.total_seconds() // 3600),
        republish=_search_republish(scope),
    )


def _search_republish(scope: Scope) -> dict[str, Any] | None:
    """The republish form fields of a search's terminal failures (None: it can hold none)."""
    statuses = [s.value for s in scope.statuses] or list(REPUBLISH_STATUSES)
    if not set(statuses) <= set(REPUBLISH_STATUSES):
        return None
    return {"statuses": sorted(statuses), **_as_fields(scope)}


def _as_fields(scope: Scope) -> dict[str, Any]:
    """A scope's conditions as form fields (times in ISO 8601)."""
    return scope_fields(
        {
            name: value.isoformat() if isinstance(value, dt.datetime) else value
            for name, value in scope.criteria().items()
        }
    )


@router.get("/messages/{message_id}")
def message(request: Request, message_id: str) -> HTMLResponse:
    session = session_of(request)
    ctx = get_ctx(request)
    check_path_id(message_id, "message id")
    found = read_message(
        ctx.engine, message_id=message_id[:MAX_FIELD], include_body=True, body_limit=BODY_READ
    )
    if found is None:
        raise ConsoleError(404, f"There is no message {message_id!r}.")
    own = {
        "batch_id": found.batch_id,
        "exchange": found.exchange,
        "message_id": found.message_id,
        "routing_key": found.routing_key,
        "stream": found.stream,
        "ordering_key": found.ordering_key,
    }
    actions = [
        e
        for e in audit_trail(ctx.engine, limit=500)
        if all(e.filter.get(name) in (None, value) for name, value in own.items())
    ]
    events = message_events(ctx.engine, outbox_id=found.id)
    return render(
        request,
        "message.html",
        session=session,
        m=found,
        history=_history(found, events),
        body=_body(found.body, size=found.body_size),
        actions=actions[:20],
        failed=found.status in TERMINAL_FAILURES,
    )


#: Most characters of a body the message page shows (the REST API has its first MiB).
BODY_SHOWN = 4096
#: Most body bytes the page reads: :data:`BODY_SHOWN` characters of UTF-8, whatever the body.
BODY_READ = 4 * BODY_SHOWN


def _body(body: bytes | None, *, size: int) -> tuple[str, str]:
    """The body to show (escaped by the template) and how: its text when it is UTF-8, else
    its first bytes in hex; cut at :data:`BODY_SHOWN` characters. ``body`` may be the first
    :data:`BODY_READ` of ``size`` bytes (a character cut at its end is left out)."""
    if body is None:
        return "", "no body"
    try:
        shown, how = (
            codecs.getincrementaldecoder("utf-8")().decode(body, final=len(body) >= size),
            "text",
        )
    except UnicodeDecodeError:
        shown, how = body[: BODY_SHOWN // 2].hex(" "), "binary, in hex"
    if len(shown) > BODY_SHOWN or len(body) < size or (how != "text" and size > BODY_SHOWN // 2):
        return shown[
            :BODY_SHOWN
        ], f"{how}, cut at {min(len(shown), BODY_SHOWN)} characters of {size} bytes"
    return shown, how


#: A step's place in a message's life, for steps recorded at the same instant (one clock
#: reading can stamp a claim, its publish and the broker's answer): written, what happened to
#: earlier attempts, this attempt's claim, its publish, what happened to it, where it is now.
WRITTEN, EARLIER, CLAIMED, PUBLISHED, ANSWERED, NOW = range(6)


def _history(m: MessageRecord, events: list[MessageEvent]) -> list[Step]:
    """Every recorded fact in time order (equal times in life order): the rare events as kept
    (``outbox_events``), then the current attempt's claim, publish and answer from the row."""
    kinds = {e.kind for e in events}
    steps: list[tuple[dt.datetime | None, int, str]] = [
        (m.created_at, WRITTEN, "written to the outbox")
    ]
    for e in events:
        earlier = e.attempt < m.attempts and e.actor is None
        steps.append((e.at, EARLIER if earlier else ANSWERED, _event_words(e)))
    if m.claimed_at:
        steps.append(
            (
                m.claimed_at,
                CLAIMED,
                f"claimed by {m.lease_owner or 'a publisher'} "
                f"(attempt {m.attempts} of {m.max_attempts})",
            )
        )
    if m.published_at:
        steps.append((m.published_at, PUBLISHED, _published(m)))
    steps += [(at, NOW, words) for at, words in _current(m, kinds)]
    if m.lost_confirms and "lost" not in kinds:
        steps.append((None, NOW, _lost(m)))
    steps.sort(key=lambda s: (s[0] is None, s[0] or m.created_at, s[1]))
    return [(at, words) for at, _place, words in steps]


def _published(m: MessageRecord) -> str:
    if m.stream is not None:
        return f"published to {m.destination}"
    where = (
        f" on channel {m.channel_id}, delivery tag {m.delivery_tag}"
        if m.delivery_tag is not None
        else ""
    )
    return f"published to {m.exchange!r}{where}"


def _lost(m: MessageRecord) -> str:
    """A row's lost confirms: possible duplicates, but for a stream's row (exactly once)."""
    if m.stream is not None:
        return (
            f"{m.lost_confirms} resend(s) under the same publishing id after a lost confirm: "
            "the broker drops a repeated id, so not a duplicate"
        )
    return f"{m.lost_confirms} confirm(s) lost to a closed channel: the broker may hold a duplicate"


def _current(m: MessageRecord, kinds: set[str]) -> list[Step]:
    """The row's own answer, unless an event already tells it (rows from before events)."""
    if m.status is Status.CONFIRMED and m.confirmed_at:
        return [(m.confirmed_at, "confirmed by the broker (ack)")]
    if m.status is Status.RETURNED and "returned" not in kinds:
        reply = f"{m.reply_code or ''} {m.reply_text or ''}".strip() or "no reply recorded"
        return [(m.confirmed_at, f"the broker returned it as unroutable ({reply}), then acked")]
    if m.status.value not in kinds and (
        m.status in TERMINAL_FAILURES or m.status is Status.SKIPPED
    ):
        reason = m.last_error or m.reply_text or "no reason recorded"
        return [(None, f"now {m.status.value}: {reason}")]
    return []


def _event_words(e: MessageEvent) -> str:
    """What happened, in the words of what the broker or the operator did."""
    detail = e.detail or "no reason recorded"
    by = f"{e.actor} (audit #{e.audit_id})"
    words = {
        "retry": f"attempt {e.attempt} failed: {detail}; retried after a backoff",
        "lost": f"attempt {e.attempt}: its confirm was lost ({detail}); back to pending, the "
        "broker may hold a duplicate",
        "returned": f"attempt {e.attempt}: the broker returned it as unroutable "
        f"({detail.removeprefix('returned by broker: ')}), then acked",
        "nacked": f"attempt {e.attempt} nacked by the broker ({detail}): no attempts left",
        "failed": f"attempt {e.attempt} failed for good: {detail}",
        "republished": f"republished by {by}: it was {e.from_status} ({detail}); back to "
        "pending, attempts from 0",
        "skipped": f"skipped by {by}: {detail}; it will not be delivered",
    }
    return words.get(e.kind, f"{e.kind}: {detail}")
