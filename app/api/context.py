"""What every request handler needs, built once by :func:`app.api.create_app`."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from fastapi import Request
from sqlalchemy import Engine

from app.api.limits import AuthThrottle
from app.outbox.actions import OperatorActions
from app.outbox.database import Clock
from app.outbox.read.stats import alive_after
from app.settings import Settings


@dataclass(frozen=True, slots=True)
class ApiContext:
    settings: Settings
    engine: Engine
    actions: OperatorActions
    clock: Clock
    head_revision: str | None
    throttle: AuthThrottle = field(default_factory=AuthThrottle)

    def now(self) -> dt.datetime:
        return self.clock()

    @property
    def alive_after(self) -> float:
        """A publisher that beat within this many seconds (and did not stop) counts as alive."""
        return alive_after(self.settings)


def client_address(request: Request) -> str:
    """The peer's address as the server saw it (behind a proxy: the proxy's, unless uvicorn is
    told to trust its forwarded headers with ``--forwarded-allow-ips``)."""
    return request.client.host if request.client else "unknown"


def get_ctx(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx
