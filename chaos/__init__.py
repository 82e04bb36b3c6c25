"""The fault matrix: real faults injected while rows flow, every message accounted for.

``python -m chaos.run`` (``make chaos``) runs every scenario of :mod:`chaos.scenarios` against a
RabbitMQ and a PostgreSQL of its own (other ports, another data directory), so stopping or killing
them never disturbs anything else on the machine. ``tests/chaos/`` checks the harness inside
``make test`` (controls, no scenario of the matrix: each runs once per CI run, in ``make chaos``).
"""
