"""A publisher's database calls on worker threads, in the order they were made, per lane.

The outbox store is synchronous; the event loop never blocks on it. There are two lanes:

- ``call``: write-backs, heartbeats, lease sweeps, registration: one thread, one at a time.
- ``claim``: claims and the release of orphaned leases. On PostgreSQL a thread (and connection)
  of its own, so a claim never waits for a write-back and a write-back never waits for a claim:
  rows committed by a producer are claimed while the previous rows' outcomes are being written
  (on one thread each waited for the other, and the confirm latency was the sum of both). On
  SQLite, one writer at a time, both lanes are one thread.

Results of one lane reach the loop in order. Across lanes they do not: a claim can return a row
that a write-back still running on the other lane has just released (say a publish lost with
its channel). The claimer waits for that write-back to finish before it accepts such a row
(:meth:`app.publisher.writeback.Writeback.settled`), so a row settled by a write-back is
forgotten before a later claim of it is accepted, as with one thread.

The lanes share what ``/readyz`` and the claimer read: when the database last answered, and how
many calls failed. An outage is logged here, once: a WARNING (with the first error's traceback)
when a call first fails, an INFO with the outage's length when a call succeeds again; the callers
retry without a line per attempt.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
#: an outage is over once a call succeeds this long after the last call that failed
SETTLED_AFTER = 1.0
log = logging.getLogger("app.publisher")


class DbThread:
    def __init__(
        self, *, claims_apart: bool = False, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.claims_apart = claims_apart
        self.clock = clock
        self._executor: ThreadPoolExecutor | None = None
        self._claims: ThreadPoolExecutor | None = None
        self.last_ok: float | None = None  # monotonic time of the last successful call
        self.last_error: str | None = None
        self.failures = 0  # calls that raised, ever, on either lane: the claimer compares it
        #: when the first call failed that no orphan check has followed yet: the undo horizon
        #: of write-backs is measured from here, not from when the check runs (a crash undoes
        #: what was written just before it, however long the outage lasts)
        self.failed_at: float | None = None
        self._down_since: float | None = None  # the outage being logged
        self._failed_last: float | None = None  # when the last call failed

    def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-db")
        self._claims = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-db-claims")
            if self.claims_apart
            else self._executor
        )

    def stop(self) -> None:
        if self._claims is not None and self._claims is not self._executor:
            self._claims.shutdown(wait=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def call(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Run ``fn(**kwargs)`` on the main lane."""
        return await self._run(self._executor, fn, kwargs)

    async def claim(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Run ``fn(**kwargs)`` on the claims' lane (the main lane on SQLite)."""
        return await self._run(self._claims, fn, kwargs)

    async def _run(
        self, executor: ThreadPoolExecutor | None, fn: Callable[..., T], kwargs: dict[str, Any]
    ) -> T:
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(executor, functools.partial(fn, **kwargs))
        except Exception as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}"
            now = self.clock()
            if self.failed_at is None:
                self.failed_at = now
            self._failed_last = now
            if self._down_since is None:
                self._down_since = now
                log.warning(
                    "a database call failed (%s); retrying, quietly until it answers",
                    self.last_error,
                    exc_info=exc,
                )
            raise
        self.last_ok = time.monotonic()
        self.last_error = None
        if self._down_since is not None and self._settled():
            log.info(
                "the database answers again after %.1fs (%d calls failed meanwhile)",
                self.clock() - self._down_since,
                self.failures,
            )
            self._down_since = None
        return result

    def _settled(self) -> bool:
        """An outage ends at a call that succeeds :data:`SETTLED_AFTER` s after the last one
        that failed. A server shutting down kills its sessions one by one: a call on a session
        not killed yet succeeded between two that failed, and the outage was logged as over
        after 0.0 s, then as begun again (scenario 19-long)."""
        last = self._failed_last
        return last is None or self.clock() - last >= SETTLED_AFTER

    def orphans_checked(self, *, failures_seen: int) -> None:
        """An orphan check that began after ``failures_seen`` failures is done: the horizon
        thaws unless a call failed since."""
        if self.failures == failures_seen:
            self.failed_at = None
