"""Which deliveries of one channel to acknowledge, and how. Pure, no I/O.

Handlers finish out of order (windows run side by side, a slow one among them). Every finished
delivery is acknowledged at once, even while an older one still runs: the broker then frees its
prefetch slot, so one slow handler never holds back the others (no head-of-line blocking).

An ack with ``multiple`` settles *every* outstanding tag up to it, so it is used only over the
unbroken run of finished deliveries at the head of the channel (acking past a delivery still
running would lose it if the consumer then died); finished deliveries behind a running one get an
ack each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Ack:
    """One ``basic.ack`` frame: ``tag`` alone, or every outstanding tag up to it (``multiple``)."""

    tag: int
    multiple: bool
    count: int  # deliveries it settles


class AckTracker:
    """Delivery tags of one channel, in the order the broker sent them."""

    def __init__(self) -> None:
        self._outstanding: dict[int, bool] = {}  # tag -> finished, in arrival (= tag) order

    def __len__(self) -> int:
        return len(self._outstanding)

    def received(self, tag: int) -> None:
        if self._outstanding and tag <= next(reversed(self._outstanding)):
            raise ValueError(
                f"delivery tag {tag} after {next(reversed(self._outstanding))}: not in order"
            )
        self._outstanding[tag] = False

    def finished(self, tag: int) -> None:
        """The handler of ``tag`` is done (its effect committed): an ack is owed."""
        if tag in self._outstanding:
            self._outstanding[tag] = True

    def settled(self, tag: int) -> None:
        """``tag`` was nacked or rejected on its own: nothing more is owed for it."""
        self._outstanding.pop(tag, None)

    def acks(self, *, multiple: bool = True) -> list[Ack]:
        """The frames that settle every finished delivery, and forget them: with ``multiple``,
        one ``multiple`` ack over the finished run at the head (if it has more than one) and a
        single ack for each finished delivery behind a running one."""
        frames: list[Ack] = []
        head = True
        run_end, run = 0, 0
        for tag, done in list(self._outstanding.items()):
            if not done:
                head = False
                continue
            del self._outstanding[tag]
            if head and multiple:
                run_end, run = tag, run + 1
            else:
                frames.append(Ack(tag, False, 1))
        if run:
            frames.insert(0, Ack(run_end, run > 1, run))
        return frames
