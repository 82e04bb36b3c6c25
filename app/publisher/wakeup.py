"""A wake-up signal that every waiter waits on with a deadline (never on the event alone)."""

from __future__ import annotations

import asyncio
import contextlib


class Signal:
    """``set()`` wakes the waiter; ``wait(timeout)`` returns after a set or the timeout."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        """Forget a ``set()`` nobody waited for yet."""
        self._event.clear()

    async def wait(self, timeout: float | None) -> bool:
        """Wait for a ``set()`` (cleared on return) or ``timeout`` seconds; True when set."""
        if timeout is not None and timeout <= 0:
            fired = self._event.is_set()
        else:
            fired = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._event.wait()
                    fired = True
        self._event.clear()
        return fired
