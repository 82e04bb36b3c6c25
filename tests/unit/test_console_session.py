"""Console sessions: signed, expiring, bound to a server secret and the tokens; CSRF per session."""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, create_engine

from app.api.auth import ApiConfigError, Role
from app.api.console import safe_next
from app.api.console.session import SessionError, SessionSigner, signing_key
from app.api.console.store import ConsoleSessions
from app.settings import Settings

READ, OPERATOR = "read-token-0123456789abcdef", "oper-token-0123456789abcdef"
SECRET = b"server-secret-0123456789abcdef0123456789"
#: Never connected to: a configured secret is read without the database.
NO_DATABASE: Engine = create_engine("sqlite://")


def signer(operator: str = OPERATOR, seconds: int = 3600, secret: bytes = SECRET) -> SessionSigner:
    return SessionSigner(key=signing_key(secret, tokens=[operator, READ]), lifetime=seconds)


def test_a_session_reads_back_until_it_expires() -> None:
    s = signer(seconds=600)
    cookie, issued = s.issue(Role.READER, "read-token", now=1000.0)
    assert s.read(cookie, now=1599.0) == issued
    assert not issued.can_act
    with pytest.raises(SessionError) as caught:
        s.read(cookie, now=1600.0)
    assert caught.value.expired


@pytest.mark.parametrize(
    "mangle",
    [
        lambda c: c.replace("UkVBREVS", "T1BFUkFUT1I"),  # READER -> OPERATOR in the payload
        lambda c: c[:-2] + ("AA" if not c.endswith("AA") else "BB"),
        lambda c: c.split(".")[0],
        lambda c: "",
        lambda c: "x.y",
    ],
)
def test_a_tampered_or_missing_cookie_is_refused(mangle: object) -> None:
    s = signer()
    cookie, _ = s.issue(Role.READER, "read-token", now=0.0)
    with pytest.raises(SessionError) as caught:
        s.read(mangle(cookie), now=1.0)  # type: ignore[operator]
    assert not caught.value.expired


def test_rotating_a_token_or_the_secret_ends_the_sessions_it_signed_and_replicas_agree() -> None:
    cookie, _ = signer().issue(Role.OPERATOR, "operator-token", now=0.0)
    assert signer().read(cookie, now=1.0).can_act  # another replica, same secret and tokens
    with pytest.raises(SessionError):
        signer(operator="oper-token-rotated-9876543210").read(cookie, now=1.0)
    with pytest.raises(SessionError):
        signer(secret=b"rotated-secret-0123456789abcdef0123456789").read(cookie, now=1.0)


def _mac_under(key: bytes, payload: str) -> str:
    digest = hmac.new(key, f"session\0{payload}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def test_a_read_cookie_cannot_be_checked_against_operator_token_guesses_offline() -> None:
    """Issue 29, Medium 1: the key was SHA-256 of the tokens, so a reader holding a session
    cookie and the read token tested operator-token guesses offline at 78,737 per second. Now
    the key needs the server's secret: even the right guess does not verify the cookie."""
    reader, operator = "read-token-0123456789", "Operator-Pass-2026"
    real = SessionSigner(key=signing_key(SECRET, tokens=[operator, reader]), lifetime=3600)
    cookie, _ = real.issue(Role.READER, "read-token", now=0.0)
    payload, _, mac = cookie.partition(".")
    for guess in ("Operator-Pass-2025", operator, "Operator-Pass-2027"):
        for tokens in ([guess, reader], [reader, guess]):
            material = "\0".join(["outbox-ui-session", *tokens]).encode()
            for key in (hashlib.sha256(material).digest(), signing_key(b"", tokens=tokens)):
                assert _mac_under(key, payload) != mac, f"{guess} verified offline"


def test_the_session_secret_comes_from_the_setting_or_its_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("f" * 64 + "\n")
    tokens = {"api_token": SecretStr(READ), "operator_token": SecretStr(OPERATOR)}
    by_file = ConsoleSessions(Settings(session_secret_file=str(path), **tokens), NO_DATABASE)
    by_env = ConsoleSessions(Settings(session_secret=SecretStr("f" * 64), **tokens), NO_DATABASE)
    one, two = by_file.loaded(), by_env.loaded()
    assert one is not None and two is not None, "a configured secret needs no database"
    cookie, _ = one.issue(Role.READER, "read-token", now=0.0)
    assert two.read(cookie, now=1.0).principal == "read-token"


@pytest.mark.parametrize(
    "values",
    [
        {"session_secret": SecretStr("too-short")},
        {"session_secret_file": "/nonexistent/secret"},
        {"session_secret": SecretStr("f" * 64), "session_secret_file": "/nonexistent/secret"},
    ],
)
def test_an_unusable_session_secret_is_refused_at_start(values: dict[str, object]) -> None:
    with pytest.raises(ApiConfigError, match=r"SESSION_SECRET|session secret"):
        ConsoleSessions(Settings(**values), NO_DATABASE)  # type: ignore[arg-type]


@pytest.mark.parametrize("cookie", ["a.\xe9", "\udcff.\udcff", "a." + "\u20ac" * 43])
def test_a_cookie_that_is_not_ascii_is_refused_not_a_crash(cookie: str) -> None:
    """Issue 29, Low: ``outbox_session=a.\\xe9`` answered 500 (compare_digest, non-ASCII)."""
    with pytest.raises(SessionError):
        signer().read(cookie, now=1.0)


def test_csrf_tokens_belong_to_one_session() -> None:
    s = signer()
    _, one = s.issue(Role.OPERATOR, "operator-token", now=0.0)
    _, two = s.issue(Role.OPERATOR, "operator-token", now=0.0)
    assert s.csrf_ok(one, s.csrf(one))
    assert not s.csrf_ok(one, s.csrf(two))
    assert not s.csrf_ok(one, None) and not s.csrf_ok(one, "")


@pytest.mark.parametrize(
    ("target", "safe"),
    [
        ("/ui/batches?status=failed", "/ui/batches?status=failed"),
        (None, "/ui"),
        ("https://evil.example/ui", "/ui"),
        ("//evil.example/ui", "/ui"),
        ("/v1/stats", "/ui"),
    ],
)
def test_sign_in_only_returns_to_console_pages(target: str | None, safe: str) -> None:
    assert safe_next(target) == safe
