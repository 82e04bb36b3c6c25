"""Which PySpark each writer needs. ``OutboxSink`` and ``write_outbox`` (``mapInArrow``, window
functions, Spark SQL's higher-order functions) run on PySpark 3.5 and later; ``format("outbox")``
needs the Python data source API with Arrow writers (``DataSourceArrowWriter``,
``DataSourceStreamArrowWriter``), which PySpark has from 4.1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyspark

from spark_writer.errors import OutboxConfigError

#: The oldest PySpark ``format("outbox")`` runs on.
DATA_SOURCE_SINCE = "4.1"


def unsupported_data_source(missing: ImportError) -> Callable[[Any], None]:
    """``register_data_source`` where this PySpark lacks the API: it says why, and what works."""

    def register_data_source(spark: Any) -> None:
        raise OutboxConfigError(
            f'format("outbox") needs PySpark {DATA_SOURCE_SINCE} or later (its Python data '
            f"source API with Arrow writers); this is PySpark {pyspark.__version__} ({missing}). "
            "OutboxSink (foreachBatch) and write_outbox work on this version."
        )

    return register_data_source
