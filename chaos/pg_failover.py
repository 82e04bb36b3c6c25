"""Scenarios 19: the outbox's PostgreSQL fails over (Patroni and etcd on loopback, see
``deploy/local/pg-ha.sh``)."""

from __future__ import annotations

from chaos.runner import Scenario

SCENARIOS: list[Scenario] = []
