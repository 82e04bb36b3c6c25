"""The kit's value types: a delivery as a handler sees it (:class:`Message`), as the kit holds it
(:class:`Held`), a job's deliveries (:class:`Window`) and what the job did (:class:`Outcome`).
Pure: standard library only (a window's lock is a ``threading.Lock``: the event loop cuts or
abandons it while a handler thread takes from it)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("app.consumer")

#: The longest handler error kept on an attempts row and in a dead letter's headers.
ERROR_CHARS = 1000


@dataclass(frozen=True, slots=True)
class Message:
    """What a handler sees of a delivery (no broker object crosses into the handler's thread)."""

    message_id: str
    body: bytes
    routing_key: str
    exchange: str
    headers: Mapping[str, Any] = field(default_factory=dict)
    content_type: str | None = None
    redelivered: bool = False
    #: how many times this message's handler started before without an outcome (raised, timed
    #: out, or its process died): the kit's own durable count
    delivery_count: int = 0


@dataclass(eq=False)
class Held:
    """A delivery the kit holds, and what is known of its attempts."""

    tag: int
    message: Message
    redelivered: bool = False
    #: this try's attempt is already counted in the attempts table
    charged: bool = False
    attempts: int = 0
    #: a handler error (or timeout) still to be recorded before anything else
    failure: str | None = None
    #: a commit of this delivery's effect whose outcome was not learned (the connection broke)
    maybe_committed: bool = False
    #: a quorum queue's ``x-delivery-count``: how often the broker had this message back
    #: (requeued, or its consumer's channel gone) before this delivery; 0 elsewhere
    broker_count: int = 0
    #: dead-lettered because ``broker_count`` reached the kit's ``broker_delivery_limit``
    broker_limited: bool = False

    @property
    def message_id(self) -> str:
        return self.message.message_id


class Window:
    """Deliveries given to one job. The handler thread takes them one by one; the event loop may
    cut the window (the deliveries not yet taken go to another job) or abandon it (a handler ran
    past its timeout: the job must not commit)."""

    def __init__(self, items: list[Held], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.items = items
        self.clock = clock
        self.created = clock()
        self._lock = threading.Lock()
        self._next = 0
        self._cut = False
        #: "abandoned" (a handler timed out) or "committing", whichever came first
        self._ending: str | None = None
        #: the delivery whose handler runs now, and since when
        self.running: tuple[Held, float] | None = None
        self.dbapi_connection: Any = None

    def take_all(self) -> list[Held]:
        """Every delivery at once (a batch handler's window): running from now, as one."""
        with self._lock:
            if self._cut or self.abandoned or self._next >= len(self.items):
                return []
            taken = self.items[self._next :]
            self._next = len(self.items)
            self.running = (taken[0], self.clock())
            return taken

    def take(self) -> Held | None:
        with self._lock:
            if self._cut or self.abandoned or self._next >= len(self.items):
                self.running = None
                return None
            held = self.items[self._next]
            self._next += 1
            self.running = (held, self.clock())
            return held

    def done_running(self) -> None:
        with self._lock:
            self.running = None

    def cut(self) -> list[Held]:
        """The deliveries not taken yet; the job takes no more."""
        with self._lock:
            self._cut = True
            rest, self.items = self.items[self._next :], self.items[: self._next]
            return rest

    def untaken(self) -> list[Held]:
        with self._lock:
            return self.items[self._next :]

    def abandon(self) -> bool:
        """The job must not commit (a handler timed out). False when it is committing already."""
        return self._end("abandoned")

    def begin_commit(self) -> bool:
        """The job commits now. False when it was abandoned (it must roll back)."""
        return self._end("committing")

    def _end(self, end: str) -> bool:
        """Abandoned or committing, whichever comes first: the other is refused after it."""
        with self._lock:
            if self._ending not in (None, end):
                return False
            self._ending = end
        return True

    def cancel_statement(self) -> None:
        """psycopg: end a statement the (abandoned) handler waits on. Blocks: a thread's job."""
        cancel = getattr(self.dbapi_connection, "cancel", None)
        if callable(cancel):
            try:
                cancel()
            except Exception:  # best effort; it rolls back when it returns
                log.debug("cancelling an abandoned handler's statement failed", exc_info=True)

    @property
    def abandoned(self) -> bool:
        return self._ending == "abandoned"


@dataclass
class Outcome:
    """What a job did with its window's deliveries."""

    handled: list[Held] = field(default_factory=list)
    deduplicated: list[Held] = field(default_factory=list)
    #: to run again (the others of a window whose handler failed, deliveries cut off, an outage)
    again: list[Held] = field(default_factory=list)
    #: to run again one message per transaction (a window failed and no handler raised)
    isolate: list[Held] = field(default_factory=list)
    #: handler failed: its ``failure`` is set; recorded by a later :func:`run_single`
    failed: list[Held] = field(default_factory=list)
    #: failures recorded: requeue these
    requeue: list[Held] = field(default_factory=list)
    #: reached the delivery limit: dead-letter these (the reason in their ``failure``)
    dead: list[Held] = field(default_factory=list)
    #: the database failed: the error, and every undecided delivery is in ``again``
    outage: BaseException | None = None
    abandoned: bool = False
    #: time spent in handlers that returned (sizes the next windows)
    handler_seconds: float = 0.0
