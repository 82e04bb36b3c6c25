"""Spark → outbox writers: ``OutboxSink`` (foreachBatch), ``write_outbox`` (batch jobs) and the
``format("outbox")`` data source. Every row lands in the outbox exactly once per ``message_id``.
"""

from spark_writer.delivery import BatchResult, Delivery
from spark_writer.envelope import derive_message_id
from spark_writer.errors import (
    OutboxConfigError,
    OutboxDataError,
    OutboxDeliveryError,
    OutboxSchemaError,
    OutboxWriterError,
    ProblemCount,
)
from spark_writer.options import DEFAULT_MAX_BODY_BYTES, OutboxOptions
from spark_writer.progress import OutboxProgress
from spark_writer.sinks import OutboxSink, SinkTotals, write_outbox
from spark_writer.writer import PartitionResult

try:  # format("outbox"): PySpark's Python data source API with Arrow writers (4.1 and later)
    from spark_writer.datasource import OutboxDataSource, register_data_source
except ImportError as missing:  # OutboxSink and write_outbox work on PySpark 3.5 and later
    from spark_writer.versions import unsupported_data_source

    register_data_source = unsupported_data_source(missing)  # type: ignore[assignment]
    OutboxDataSource = None  # type: ignore[assignment,misc]  # keeps `import *` working

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "BatchResult",
    "Delivery",
    "OutboxConfigError",
    "OutboxDataError",
    "OutboxDataSource",
    "OutboxDeliveryError",
    "OutboxOptions",
    "OutboxProgress",
    "OutboxSchemaError",
    "OutboxSink",
    "OutboxWriterError",
    "PartitionResult",
    "ProblemCount",
    "SinkTotals",
    "derive_message_id",
    "register_data_source",
    "write_outbox",
]
