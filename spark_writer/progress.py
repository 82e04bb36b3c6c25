"""Delivery beside Spark's own progress: a ``StreamingQueryListener`` that joins each micro-batch's
``StreamingQueryProgress`` with what the outbox did with that batch.

Why a listener: PySpark gives a Python sink no metric of its own. A ``foreachBatch`` sink's
``numOutputRows`` is -1 and ``observe()`` inside the function reaches no progress; a Python
data source's write reports Spark's fixed Python worker metrics only (``PythonCustomMetric``:
data sent, time spent), and ``sink.numOutputRows`` counts the rows handed to it. So the
delivery figures live here, per micro-batch, beside a copy of Spark's progress, and in one log
line per batch (logger ``spark_writer.progress``).

``spark.streams.addListener(sink.progress)`` for an ``OutboxSink`` (its results, written,
replays, rejects and the ``Delivery``, are handed over in the driver's process);
``OutboxProgress(url=..., sink=..., query_name=...)`` for ``format("outbox")`` or where the
sink's function runs in another process (Spark Connect): the listener then reads the batch's
rows per status from the outbox, one aggregate over the batch's index per micro-batch.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict, deque
from typing import Any

from pyspark.sql.streaming.listener import StreamingQueryListener

from spark_writer.db import open_store
from spark_writer.delivery import FAILURES, BatchResult, Delivery, delivery_of
from spark_writer.watch import BatchRows

log = logging.getLogger("spark_writer.progress")


class OutboxProgress(StreamingQueryListener):
    """Each micro-batch's progress with an ``"outbox"`` section: ``progress(query)`` lists them
    (oldest first, the last ``keep`` per query), ``last(query)`` is the newest.

    ``"outbox"`` holds ``batchId`` (the outbox's ``batch_id``), ``rows`` and the rows per
    status when the progress came (``confirmed``, ``returned``, ``nacked``, ``failed``,
    ``skipped``, ``pending``, ``inFlight``: final with ``wait="confirmed"``, what the
    publisher had done so far without), and from an ``OutboxSink`` in this process also
    ``written``, ``duplicates``, ``rejected``, ``replayed`` and ``waitSeconds``.
    """

    def __init__(
        self,
        *,
        url: str,
        sink: str,
        query_name: str | None = None,
        password_file: str | None = None,
        keep: int = 100,
    ) -> None:
        self.url = url
        self.sink = sink
        self.query_name = query_name
        self.password_file = password_file
        self.keep = keep
        self._lock = threading.Lock()
        self._results: OrderedDict[tuple[str, int], BatchResult] = OrderedDict()
        self._history: dict[str, deque[dict[str, Any]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (Spark Connect ships a ``foreachBatch`` function, and on 3.5 a listener, to
        the server): the settings travel, the lock and what was kept do not."""
        state = self.__dict__.copy()
        for name in ("_lock", "_results", "_history"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._results = OrderedDict()
        self._history = {}

    # --- fed by OutboxSink, in the driver's process --------------------------------------------

    def record(self, query_id: str | None, result: BatchResult, spark_batch_id: int) -> None:
        """What the sink did with one micro-batch of query ``query_id``."""
        if query_id is None:
            return
        with self._lock:
            self._results[(query_id, spark_batch_id)] = result
            while len(self._results) > self.keep:
                self._results.popitem(last=False)

    # --- read by the job ------------------------------------------------------------------------

    def progress(self, query: Any) -> list[dict[str, Any]]:
        """Every kept micro-batch progress of ``query`` (a ``StreamingQuery`` or its id)."""
        with self._lock:
            return list(self._history.get(_query_key(query), ()))

    def last(self, query: Any) -> dict[str, Any] | None:
        kept = self.progress(query)
        return kept[-1] if kept else None

    # --- the listener ---------------------------------------------------------------------------

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        try:
            self._progress(event.progress)
        except Exception:  # a listener must never take the query down
            log.exception("outbox progress: could not read the batch's delivery")

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass

    def _progress(self, progress: Any) -> None:
        query_id, batch_id = str(progress.id), int(progress.batchId)
        with self._lock:
            result = self._results.pop((query_id, batch_id), None)
        if result is None and not self._mine(progress):
            return
        outbox = self._outbox(result, batch_id)
        if outbox is None:  # no micro-batch ran (no new data): nothing of the outbox's
            return
        doc = json.loads(progress.json)
        doc["outbox"] = outbox
        with self._lock:
            kept = self._history.setdefault(query_id, deque(maxlen=self.keep))
            kept.append(doc)
        log.info("%s", progress_line(doc))

    def _mine(self, progress: Any) -> bool:
        return self.query_name is not None and progress.name == self.query_name

    def _outbox(self, result: BatchResult | None, batch_id: int) -> dict[str, Any] | None:
        if result is not None and result.delivery is not None:
            return outbox_section(result.delivery, result)
        key = result.batch_id if result is not None else f"{self.sink}:{batch_id}"
        with open_store(self.url, password_file=self.password_file) as store:
            poll = BatchRows(store, key).poll()
        if result is None and not poll.counts:
            return None
        return outbox_section(delivery_of(key, poll), result)


def outbox_section(delivery: Delivery, result: BatchResult | None) -> dict[str, Any]:
    """The ``"outbox"`` entry of a micro-batch's progress (camelCase, as Spark's keys)."""
    d = delivery
    doc: dict[str, Any] = {"batchId": d.batch_id, "rows": d.rows, "confirmed": d.confirmed}
    doc |= {s: getattr(d, s) for s in FAILURES}
    doc |= {"pending": d.pending, "inFlight": d.in_flight}
    if result is not None:
        doc |= {
            "written": result.written,
            "duplicates": result.duplicates,
            "rejected": result.rejected,
            "replayed": result.replayed,
        }
        if result.delivery is not None:
            doc["waitSeconds"] = round(result.delivery.waited, 3)
    return doc


def progress_line(doc: dict[str, Any]) -> str:
    """One line per micro-batch: Spark's figures, then the outbox's."""
    o = doc["outbox"]
    written = f"{o['written']} written, " if "written" in o else ""
    failed = ", ".join(f"{o[s]} {s}" for s in FAILURES)
    took = doc.get("durationMs", {}).get("triggerExecution")
    return (
        f"query {doc.get('name') or doc.get('id')} batch {doc.get('batchId')}: "
        f"{doc.get('numInputRows')} input rows in {took} ms; outbox batch {o['batchId']}: "
        f"{written}{o['confirmed']} confirmed, {failed}, {o['pending'] + o['inFlight']} open"
    )


def _query_key(query: Any) -> str:
    return str(getattr(query, "id", query))
