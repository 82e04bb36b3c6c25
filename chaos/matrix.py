"""Every scenario of the fault matrix, by key: the single-server and cluster faults of
:mod:`chaos.scenarios`, the database failovers of :mod:`chaos.pg_failover`, the network
partition of :mod:`chaos.partition` and the stream destinations of :mod:`chaos.streams`."""

from __future__ import annotations

from chaos import partition, pg_failover, scenarios, streams
from chaos.runner import Scenario

SCENARIOS: list[Scenario] = [
    *scenarios.SCENARIOS,
    *pg_failover.SCENARIOS,
    *partition.SCENARIOS,
    *streams.SCENARIOS,
]
BY_KEY = {s.key: s for s in SCENARIOS}
assert len(BY_KEY) == len(SCENARIOS), "two scenarios share a key"
