"""Console sessions: signed, expiring, bound to the tokens that signed them; CSRF per session."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from app.api.auth import Role
from app.api.console import _safe_next
from app.api.console.session import SessionError, SessionSigner
from app.settings import Settings

READ, OPERATOR = "read-token-0123456789abcdef", "oper-token-0123456789abcdef"


def signer(operator: str = OPERATOR, seconds: int = 3600) -> SessionSigner:
    return SessionSigner(Settings(api_token=SecretStr(READ), operator_token=SecretStr(operator),
                                  ui_session_seconds=seconds))  # fmt: skip


def test_a_session_reads_back_until_it_expires() -> None:
    s = signer(seconds=600)
    cookie, issued = s.issue(Role.READER, "read-token", now=1000.0)
    assert s.read(cookie, now=1599.0) == issued
    assert not issued.can_act
    with pytest.raises(SessionError) as caught:
        s.read(cookie, now=1600.0)
    assert caught.value.expired


@pytest.mark.parametrize("mangle", [
    lambda c: c.replace("UkVBREVS", "T1BFUkFUT1I"),  # READER -> OPERATOR in the payload
    lambda c: c[:-2] + ("AA" if not c.endswith("AA") else "BB"),
    lambda c: c.split(".")[0],
    lambda c: "",
    lambda c: "x.y",
])  # fmt: skip
def test_a_tampered_or_missing_cookie_is_refused(mangle: object) -> None:
    s = signer()
    cookie, _ = s.issue(Role.READER, "read-token", now=0.0)
    with pytest.raises(SessionError) as caught:
        s.read(mangle(cookie), now=1.0)  # type: ignore[operator]
    assert not caught.value.expired


def test_rotating_a_token_ends_the_sessions_it_signed_and_replicas_agree() -> None:
    cookie, _ = signer().issue(Role.OPERATOR, "operator-token", now=0.0)
    assert signer().read(cookie, now=1.0).can_act  # another replica, same tokens
    with pytest.raises(SessionError):
        signer(operator="oper-token-rotated-9876543210").read(cookie, now=1.0)


def test_csrf_tokens_belong_to_one_session() -> None:
    s = signer()
    _, one = s.issue(Role.OPERATOR, "operator-token", now=0.0)
    _, two = s.issue(Role.OPERATOR, "operator-token", now=0.0)
    assert s.csrf_ok(one, s.csrf(one))
    assert not s.csrf_ok(one, s.csrf(two))
    assert not s.csrf_ok(one, None) and not s.csrf_ok(one, "")


@pytest.mark.parametrize(("target", "safe"), [
    ("/ui/batches?status=failed", "/ui/batches?status=failed"), (None, "/ui"),
    ("https://evil.example/ui", "/ui"), ("//evil.example/ui", "/ui"), ("/v1/stats", "/ui"),
])  # fmt: skip
def test_sign_in_only_returns_to_console_pages(target: str | None, safe: str) -> None:
    assert _safe_next(target) == safe
