"""``outbox purge --every --metrics-port``: the trickle's own ``/metrics``, ``/healthz`` and
``/readyz``, so a dashboard shows its passes and an alert fires when they stop succeeding
(``OutboxPurgeStalled``: rows past retention pile up, nothing else says so).

The passes run in the main thread (blocking database calls); the probes are served from an
event loop in a thread of their own, reading the loop's counters (plain ints and floats,
written by one thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from app.outbox.purging import PurgeLoop
from app.probes import ProbeServer, check_route, metrics_route


class PurgeCollector(Collector):
    def __init__(self, loop: PurgeLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[Any]:
        total = self.loop.total
        passes = CounterMetricFamily(
            "outbox_purge_passes", "Purge passes run, by result.", labels=["result"]
        )
        passes.add_metric(["ok"], total.passes - total.failed_passes)
        passes.add_metric(["failed"], total.failed_passes)
        yield passes
        deleted = CounterMetricFamily(
            "outbox_purge_deleted_rows",
            "Rows deleted: confirmed outbox rows past retention, consumer inbox rows.",
            labels=["table"],
        )
        deleted.add_metric(["outbox"], total.deleted)
        deleted.add_metric(["inbox"], total.inbox_deleted)
        yield deleted
        yield CounterMetricFamily(
            "outbox_purge_pass_seconds", "Time spent in passes.", value=total.seconds
        )
        yield CounterMetricFamily(
            "outbox_purge_read_rows",
            "Outbox rows the passes read (deleted, kept, and one window past retention).",
            value=total.read,
        )
        yield CounterMetricFamily(
            "outbox_purge_full_walks",
            "Passes that walked from the table's first row (the others start at a floor).",
            value=total.full_walks,
        )
        yield GaugeMetricFamily(
            "outbox_purge_last_success_timestamp_seconds",
            "When a pass last succeeded (the process's start until one has), Unix time.",
            value=self.loop.last_success,
        )
        yield GaugeMetricFamily(
            "outbox_purge_every_seconds",
            "The pause between passes (--every).",
            value=self.loop.schedule.every,
        )


def purge_probes(loop: PurgeLoop, *, host: str, port: int) -> ProbeServer:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PurgeCollector(loop))

    def alive() -> tuple[bool, dict[str, object]]:
        return True, {"passes": loop.total.passes}

    def ready() -> tuple[bool, dict[str, object]]:
        """Ready while the latest pass succeeded (not before the first has)."""
        age = round(loop.wall() - loop.last_success, 3)
        details: dict[str, object] = {"passes": loop.total.passes, "last_success_age_s": age}
        if loop.failing is not None:
            details["failing"] = loop.failing
        return loop.total.passes > 0 and loop.failing is None, details

    routes = {
        "/metrics": metrics_route(registry),
        "/healthz": check_route(alive),
        "/readyz": check_route(ready),
    }
    return ProbeServer(routes, host=host, port=port)


class ProbesThread:
    """A :class:`ProbeServer` on an event loop of its own thread (the caller's thread blocks)."""

    def __init__(self, server: ProbeServer) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="purge-probes", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> str:
        """Serve; the base URL. Raises what binding raised (a port in use, say)."""
        self._thread.start()
        self._started.wait(10)
        if self._error is not None:
            raise self._error
        url = self.server.url
        if url is None:
            raise OSError("the probes did not start within 10 s")
        return url

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.start())
        except BaseException as exc:  # reported by start() in the caller's thread
            self._error = exc
            self._started.set()
            self._loop.close()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self.server.close())
        self._loop.close()
