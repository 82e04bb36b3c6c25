"""All of a publisher's database calls on one worker thread, in the order they were made.

The repository is synchronous; the event loop never blocks on it. One thread means no two calls
overlap, so a write-back's transaction never runs beside a claim, and results reach the loop in
order. The thread also remembers when the database last answered (for ``/readyz``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class DbThread:
    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self.last_ok: float | None = None  # monotonic time of the last successful call
        self.last_error: str | None = None
        self.failures = 0  # calls that raised, ever: a claimer compares it (lost commits)

    def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-db")

    def stop(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def call(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._executor, functools.partial(fn, **kwargs))
        except Exception as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}"
            raise
        self.last_ok = time.monotonic()
        self.last_error = None
        return result
