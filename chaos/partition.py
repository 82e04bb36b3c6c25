"""Scenario 20: a real network partition of the three-node RabbitMQ cluster (nodes in network
namespaces of the scenario's own, see ``deploy/local/netns-cluster.sh``)."""

from __future__ import annotations

from chaos.runner import Scenario

SCENARIOS: list[Scenario] = []
