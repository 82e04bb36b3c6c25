"""The republish filter owns its rules (issue #28): one value for the API, the CLI and the
console (pure: tests/unit/test_pure_imports.py checks that it loads no database stack)."""

from __future__ import annotations

import datetime as dt

import pytest

from app.outbox.scope import RepublishFilter, Scope, ScopeError
from app.outbox.states import TERMINAL_FAILURES, Status

T = dt.datetime(2026, 11, 24, 10, tzinfo=dt.UTC)


def test_a_request_that_names_no_condition_is_refused_unless_it_says_everything() -> None:
    with pytest.raises(ScopeError, match="say what to republish"):
        RepublishFilter.of()
    with pytest.raises(ScopeError, match="say what to republish"):
        RepublishFilter.of(exchange=None, routing_key=None)
    assert RepublishFilter.of(everything=True).statuses == TERMINAL_FAILURES
    assert RepublishFilter.of(statuses=["nacked"]).statuses == {Status.NACKED}


@pytest.mark.parametrize(
    "bad",
    [
        {"created_after": T, "created_before": T},
        {"created_after": T.replace(tzinfo=None)},
        {"statuses": ["confirmed"]},
        {"statuses": ["nope"]},
        {"cause": "x" * 501},
    ],
)
def test_the_rules_hold_whoever_builds_the_filter(bad: dict[str, object]) -> None:
    with pytest.raises(ScopeError):
        RepublishFilter.of(exchange="orders", **bad)  # type: ignore[arg-type]


def test_every_condition_is_in_the_words_and_in_the_audit_document() -> None:
    flt = RepublishFilter.of(
        statuses=["returned"],
        exchange="orders",
        routing_key="apac",
        reason="no_route",
        cause="returned by broker: 312 NO_ROUTE",
        batch_id="b:1",
        ordering_key="k",
        message_id="m-1",
        created_after=T,
        created_before=T + dt.timedelta(hours=1),
    )
    assert flt.describe() == (
        "status returned, message 'm-1', batch 'b:1', exchange 'orders', routing key 'apac', "
        "ordering key 'k', reason containing 'no_route', reason 'returned by broker: 312 "
        "NO_ROUTE', written from 2026-11-24 10:00:00 UTC, written before 2026-11-24 11:00:00 UTC"
    )
    doc = flt.as_json()
    assert {k: doc[k] for k in ("routing_key", "reason", "cause", "message_id")} == {
        "routing_key": "apac",
        "reason": "no_route",
        "message_id": "m-1",
        "cause": "returned by broker: 312 NO_ROUTE",
    }
    assert Scope(cause="").describe() == "any status, no reason recorded"


def test_an_audit_document_of_before_the_new_conditions_still_compares_equal() -> None:
    """A request id of an older release replays: the new keys appear only when set."""
    old = {
        "batch_id": "orders:1",
        "statuses": ["nacked"],
        "exchange": None,
        "created_after": None,
        "created_before": None,
    }
    assert RepublishFilter.of(batch_id="orders:1", statuses=["nacked"]).as_json() == old


def test_a_stream_is_a_condition_named_in_words_and_in_the_audit_only_when_set() -> None:
    flt = RepublishFilter.of(stream="orders-stream", cause="")
    assert flt.describe() == (
        "status failed or nacked or returned, stream 'orders-stream', no reason recorded"
    )
    assert flt.as_json()["stream"] == "orders-stream"
    assert "stream" not in RepublishFilter.of(exchange="orders").as_json()
    assert Scope(stream="s").criteria() == {"stream": "s"}


@pytest.mark.parametrize("bad", ["", "a\x00b", "a\nb", "s" * 256, "\u00e9" * 128, "amq.x"])
def test_a_stream_rabbitmq_would_refuse_is_refused_by_every_scope(bad: str) -> None:
    with pytest.raises(ScopeError, match="stream name"):
        Scope(stream=bad)
    with pytest.raises(ScopeError, match="stream name"):
        RepublishFilter.of(stream=bad)
