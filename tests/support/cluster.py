"""The three-node RabbitMQ cluster of the tests (``deploy/local/cluster.sh``), the same helper
the fault matrix drives (:class:`chaos.services.Cluster`): the suite's own ports
(``OUTBOX_TEST_CLUSTER_PORT``, default 5791, nodes on that and the next two) and data under
``OUTBOX_TEST_LOCAL_DIR``; started by a session fixture and stopped after the session."""

from __future__ import annotations

from chaos.services import Cluster, rabbitmq_missing

__all__ = ["Cluster", "rabbitmq_missing"]
