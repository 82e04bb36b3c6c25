"""Web console sessions: a signed cookie naming a session the server keeps, and CSRF tokens
bound to it.

The cookie holds the role, the principal (which token signed in), an expiry and a random session
id, signed with HMAC-SHA256 under a key derived from a server-side secret and the API's tokens
(:func:`signing_key`): without the secret (``OUTBOX_SESSION_SECRET``, or 32 random bytes kept in
the database) a cookie says nothing about the tokens, so a reader cannot test guesses of the
operator token against it offline. Rotating the secret or a token ends every session signed with
it; signing out ends one (:mod:`app.api.console.store` keeps the live session ids). A
state-changing form carries ``csrf``, an HMAC of the session id: a form posted from elsewhere, or
from an older session, does not have it. The cookie is ``HttpOnly`` and ``SameSite=Strict`` (and
``Secure`` when the console is served over HTTPS). This module does no I/O.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from app.api.auth import Role

COOKIE = "outbox_session"
COOKIE_PATH = "/ui"


class SessionError(Exception):
    """No usable session: ``expired`` tells a stale session from a missing or forged one."""

    def __init__(self, message: str, *, expired: bool = False) -> None:
        super().__init__(message)
        self.expired = expired


@dataclass(frozen=True, slots=True)
class Session:
    role: Role
    principal: str
    expires: int
    nonce: str

    @property
    def can_act(self) -> bool:
        return self.role >= Role.OPERATOR


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def signing_key(secret: bytes, *, tokens: list[str]) -> bytes:
    """The session key: the server's secret, bound to the tokens (rotating either ends sessions)."""
    material = "\0".join(["outbox-ui-session", *tokens]).encode()
    return hmac.new(secret, material, hashlib.sha256).digest()


class SessionSigner:
    def __init__(self, *, key: bytes, lifetime: int) -> None:
        self._key = key
        self.lifetime = lifetime

    def _mac(self, purpose: str, data: str) -> str:
        return _b64(hmac.new(self._key, f"{purpose}\0{data}".encode(), hashlib.sha256).digest())

    def issue(self, role: Role, principal: str, *, now: float) -> tuple[str, Session]:
        session = Session(
            role=role,
            principal=principal,
            expires=int(now) + self.lifetime,
            nonce=secrets.token_urlsafe(16),
        )
        doc = {"r": role.name, "p": principal, "e": session.expires, "n": session.nonce}
        payload = _b64(json.dumps(doc, separators=(",", ":")).encode())
        return f"{payload}.{self._mac('session', payload)}", session

    def read(self, cookie: str | None, *, now: float) -> Session:
        if not cookie:
            raise SessionError("sign in to use the console")
        if not cookie.isascii():  # compare_digest refuses a non-ASCII str (a 500 before)
            raise SessionError("the session cookie is unreadable")
        payload, _, mac = cookie.partition(".")
        if not mac or not hmac.compare_digest(mac, self._mac("session", payload)):
            raise SessionError("the session is not valid here (signed with another token?)")
        try:
            doc = json.loads(_unb64(payload))
            session = Session(
                role=Role[doc["r"]],
                principal=str(doc["p"]),
                expires=int(doc["e"]),
                nonce=str(doc["n"]),
            )
        except (ValueError, KeyError, TypeError):
            raise SessionError("the session cookie is unreadable") from None
        if session.expires <= now:
            raise SessionError("the session expired: sign in again", expired=True)
        return session

    def csrf(self, session: Session) -> str:
        return self._mac("csrf", session.nonce)

    def csrf_ok(self, session: Session, given: str | None) -> bool:
        expected = self.csrf(session).encode()
        return bool(given) and hmac.compare_digest(
            str(given).encode("utf-8", "surrogateescape"), expected
        )
