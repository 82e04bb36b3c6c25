"""Which deliveries of one channel may be acknowledged, and with ``multiple``. Pure, no I/O.

A handler may finish out of order (several run at once); the kit acknowledges only what has
finished, and uses ``multiple=true`` only over a contiguous run of finished deliveries: an ack
with ``multiple`` settles *every* outstanding tag up to it, so one unfinished delivery below the
tag would be acknowledged before its handler ran (lost if the consumer then died).
"""

from __future__ import annotations

from collections import deque


class AckTracker:
    """Delivery tags of one channel, in the order the broker sent them."""

    def __init__(self) -> None:
        self._outstanding: deque[int] = deque()  # received, not yet acked/nacked, in order
        self._finished: set[int] = set()  # handler done, ack owed
        self._gone: set[int] = set()  # settled on their own (nack/reject), skip in the run

    def __len__(self) -> int:
        return len(self._outstanding)

    def received(self, tag: int) -> None:
        if self._outstanding and tag <= self._outstanding[-1]:
            raise ValueError(f"delivery tag {tag} after {self._outstanding[-1]}: not in order")
        self._outstanding.append(tag)

    def finished(self, tag: int) -> None:
        """The handler of ``tag`` is done (its effect committed): an ack is owed."""
        self._finished.add(tag)

    def settled(self, tag: int) -> None:
        """``tag`` was nacked or rejected on its own: it leaves the run."""
        self._gone.add(tag)

    def ackable(self) -> tuple[int, int] | None:
        """``(tag, count)``: ack ``tag`` with ``multiple=True`` to settle ``count`` finished
        deliveries (the longest finished prefix); None when the oldest is still running."""
        last, count = None, 0
        while self._outstanding:
            head = self._outstanding[0]
            if head in self._gone:
                self._gone.discard(head)
                self._outstanding.popleft()
            elif head in self._finished:
                self._finished.discard(head)
                self._outstanding.popleft()
                last, count = head, count + 1
            else:
                break
        return None if last is None else (last, count)
